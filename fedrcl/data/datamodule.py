"""FederatedDataModule: a dataset, its split into clients, and one round's batches served on the device."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, Optional, get_args

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from fedrcl.data.augment import augment_batch
from fedrcl.data.datasets import DATASETS, DatasetInfo, ImageData, dataset_info, load_dataset
from fedrcl.data.domains import DomainAccuracy, assign_domains, domain_partition
from fedrcl.data.feature_skew import SEVERITIES, FeatureShift, make_shift
from fedrcl.data.huggingface import Columns, Partitioner, flower_partition
from fedrcl.data.partition import dirichlet_partition, iid_partition, shard_partition
from fedrcl.data.sources import OWN_DATASETS, own_data_shape, read_own_data
from fedrcl.data.validation import hold_out
from fedrcl.data.split_file import (SplitFile, authors_split_name, check_labels, check_split, label_fingerprint,
                                     read_split_file, write_split)
from fedrcl.contract.plan import RoundPlan, TrainedElsewhere
from fedrcl.contract.step_mask import client_batch_sizes, masked_batch, step_groups, uniform

Partition = Literal["dirichlet", "dirichlet_unbalanced", "shards", "iid", "natural"]


def stream_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (seed, round, client, ...), independent per key tuple."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0] >> np.uint64(1))


def channels_last_breaks(model: nn.Module) -> list[str]:
    """The layers of ``model`` whose CPU backward is broken in the channels-last layout: 1x1 convolutions
    with a stride and fewer than 8 input channels (ResNet-18's shortcuts below width 8). oneDNN 3.12 in
    PyTorch 2.14.1 corrupts memory there (a crash, or a hang with two threads; seen on an AVX2 CPU for 1-7
    input channels; kernel 3, stride 1 or 3, and 8 or more channels ran, yet every stride above 1 is named)."""
    return [name for name, layer in model.named_modules()
            if isinstance(layer, nn.Conv2d) and layer.kernel_size == (1, 1) and layer.stride != (1, 1)
            and layer.in_channels < 8]


class FederatedDataModule(L.LightningDataModule):
    """A federated image dataset: train set split into clients, whole test set for the global model.

    Train and test images live as uint8 tensors on the training device. A batch is one gather with an
    index tensor followed by augmentation of the whole batch on the device (``fedrcl.data.augment``); no
    per-sample collate. Batch order and augmentation of client ``k`` in round ``r`` come from a generator
    seeded by (trainer seed, r, k), so they do not depend on the method, on earlier rounds or on resuming.
    At the start of ``fit`` the split in use is written beside the run's config.yaml as ``split.json``
    (``fedrcl.data.split_file``), which ``partition_file`` reads back.

    Args:
        dataset: one of ``cifar10``, ``cifar100``, ``tinyimagenet``, ``digits`` (scikit-learn's 8x8
            digits, bundled, for offline runs), or your own data at ``root`` (``fedrcl.data.sources``, docs/data.md):
            ``npz`` (a file with ``x_train``, ``y_train``, ``x_test``, ``y_test``, optional ``classes``),
            ``imagefolder`` (``DIR/train/<class>/*``, ``DIR/test/<class>/*``), ``domainfolder``
            (``DIR/<domain>/<class>/*``: domain skew), ``leaf`` (LEAF's JSON, ``DIR/train``, ``DIR/test``) or
            ``huggingface`` (a Hugging Face data set on disk, ``fedrcl.data.huggingface``).
        root: folder holding ``<dataset>.npz`` (made on first use from the raw data found or downloaded here);
            for your own data the file or folder itself.
        download: download CIFAR through torchvision when the data is not in ``root``.
        num_clients: number of clients the train set is split into.
        partition: ``dirichlet`` (balanced Dirichlet label skew of the FedRCL code: equal client sizes),
            ``dirichlet_unbalanced`` (classic per-class Dirichlet), ``shards`` (quantity-based label skew),
            ``iid``.
        alpha: Dirichlet concentration (> 0); smaller is more skewed. Used by the Dirichlet partitions.
        shards_per_client: label shards per client (the paper's gamma); used by ``shards``.
        seed: seed of the client split (the split is a property of the dataset, not of the method).
        partition_file: read the client split from this file instead of computing it (``partition``,
            ``alpha``, ``shards_per_client`` and ``seed`` then only label the run). Either a run's
            ``split.json`` (``fedrcl-split/1``) or one of the FedRCL authors' released
            ``client_data/<DATASET>/balanced/dirichlet<alpha>_clients<N>.txt`` files; for the latter
            ``partition`` must be ``dirichlet`` and ``alpha`` the file name's. The authors' indices refer
            to torchvision's CIFAR order, so use them only with data built here from torchvision's
            download (``download: true``); an ``.npz`` made elsewhere (e.g. ``../shared/data/cifar10.npz``)
            may hold the images in another order, and for Tiny-ImageNet the order of the authors' loader is
            unverified. Checked before training: client count == ``num_clients``, indices inside the
            train set, no index held twice, and (a ``split.json`` written since fedrcl records it) the same
            train labels as the split was made for; a file that records none is used with a notice.
        batch_size: local mini-batch size. null (with ``local_iters_per_epoch`` set): the smallest client's
            size divided by ``local_iters_per_epoch``, the paper's rule ("the batch size is adjusted to
            ensure 10 local iterations at each local epoch": 50 for 500 samples, 10 for 100).
        local_iters_per_epoch: steps per local epoch. ``None``: one pass over the client's data
            (ceil(n / batch_size) steps, the last batch smaller). An int: exactly that many full batches,
            drawn from consecutive shuffles of the client's data (the paper: 10).
        eval_batch_size: batch size for evaluating the global model on the test set.
        augment: random rotation, crop with padding and horizontal flip on training batches.
        views: independently augmented views of each training batch (2 for two-view methods such as
            FedCL). With V views a batch of B images is ``(cat([x_1, ..., x_V]), y.repeat(V))``: ``V * B``
            rows, view ``v`` in rows ``v*B:(v+1)*B``. The first view draws the same random numbers as with
            ``views: 1``; the others draw after it.
        channels_last: image batches in the channels-last memory layout (the same values, NHWC strides), in
            which PyTorch's CPU convolutions run faster (``bench/memory_layout.py``, one thread: a small-CNN
            round 1.40x); ``auto``: on when the data lives on the CPU (unless ``channels_last_breaks`` names a
            layer of the model), off on CUDA (not measured there). The same maths, rounded in another order; the
            weights keep their layout.
        image_size: your own data's images resized to this side (antialiased bilinear, once at load); null: the
            data's own size (square). Not for the named data sets.
        hflip: random horizontal flips in ``augment``; null: the named data set's habit (not for digits), on for
            your own data (turn it off for letters and digits).
        test_fraction: the share of each domain's images per class held out as its test set (``domainfolder``,
            which ships no test folders), seeded by ``seed``.
        feature_skew: input shifts, one domain each (``fedrcl.data.feature_skew.SEVERITIES``' names: ``none``,
            ``rotation``, ``colour_shift``, ``gaussian_noise``, ``shot_noise``, ``impulse_noise``, ``speckle_noise``,
            ``gaussian_blur``, ``contrast``, ``brightness``, ``pixelate``); every client gets one domain (balanced,
            seeded) and sees its data through that shift, on the device; the labels' split is unchanged. The test
            set is evaluated under each shift (``val/acc/<shift>``) and ``val/acc`` is their mean. null: none.
        feature_skew_severity: severity 1-5 of the shifts (CIFAR-10-C's scale).
        domain_split: how clients get data with domains (``domainfolder``, or an ``npz`` with domain arrays):
            ``one`` (each client one domain, its samples split by ``partition``) or ``dirichlet`` (each client's
            mix of domains drawn from a balanced Dirichlet of ``domain_alpha``; ``partition`` then unused).
        domain_alpha: Dirichlet concentration over domains for ``domain_split: dirichlet``.
        image_column: a Hugging Face data set's image column (``huggingface``).
        label_column: a Hugging Face data set's label column (``huggingface``).
        client_column: a Hugging Face data set's column naming each sample's natural client (a writer, a
            hospital), for ``partition: natural``; null: none.
        domain_column: a Hugging Face data set's column naming each sample's domain (domain skew); null: none.
        partitioner: a Flower Datasets partitioner in place of ``partition`` (the ``data`` extra), e.g.
            ``flwr_datasets.partitioner.DirichletPartitioner`` with ``init_args`` ``partition_by: label`` and
            ``alpha``; built with ``num_partitions = num_clients`` over a table of the train set's ``label``
            (and ``client``, ``domain``) columns (``fedrcl.data.huggingface.flower_partition``). null: fedrcl's own.
        val_fraction: the share of every client's training samples held out as the validation set
            (``fedrcl.data.validation``, seeded by ``seed``; ``split.json`` keeps the whole parts). 0: none, and
            ``val/acc`` is the test accuracy, as the paper reports it. Above 0: ``val/acc`` and ``val/acc_ema``
            are the global model's accuracy on the validation set, ``test/acc`` and ``test/acc_ema`` on the
            test set (docs/tuning.md). In [0, 1); not with domains (``feature_skew``, domain data).
    """

    def __init__(
        self,
        dataset: str = "cifar10",
        root: str = "data",
        download: bool = False,
        num_clients: int = 100,
        partition: Partition = "dirichlet",
        alpha: float = 0.3,
        shards_per_client: int = 2,
        seed: int = 0,
        partition_file: Optional[str] = None,
        batch_size: Optional[int] = 50,
        local_iters_per_epoch: Optional[int] = None,
        eval_batch_size: int = 1000,
        augment: bool = True,
        views: int = 1,
        channels_last: Literal["auto", "on", "off"] = "auto",
        image_size: Optional[int] = None,
        hflip: Optional[bool] = None,
        test_fraction: float = 0.2,
        feature_skew: Optional[list[str]] = None,
        feature_skew_severity: int = 3,
        domain_split: Literal["one", "dirichlet"] = "one",
        domain_alpha: float = 1.0,
        image_column: str = "image",
        label_column: str = "label",
        client_column: Optional[str] = None,
        domain_column: Optional[str] = None,
        partitioner: Optional[Callable[[int], Partitioner]] = None,
        val_fraction: float = 0.0,
    ):
        super().__init__()
        self.own_data = dataset in OWN_DATASETS
        if not self.own_data:
            dataset_info(dataset)  # an unknown name is named with the allowed ones
            if image_size is not None and image_size != DATASETS[dataset].image_size:
                raise ValueError(f"data.image_size resizes your own data (data.dataset {', '.join(OWN_DATASETS)}); "
                                 f"{dataset} is {DATASETS[dataset].image_size} px, got {image_size}")
        if not 0 < test_fraction < 1:
            raise ValueError(f"data.test_fraction must be in (0, 1), got {test_fraction}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if val_fraction > 0 and feature_skew is not None:
            raise ValueError("data.val_fraction with data.feature_skew: the validation set is not evaluated per "
                             "domain yet; set data.val_fraction 0 (val/acc is then the test accuracy)")
        if feature_skew is not None:
            unknown = [k for k in feature_skew if k not in SEVERITIES]
            if unknown or not feature_skew:
                raise ValueError(f"data.feature_skew: {'unknown shift ' + repr(unknown[0]) if unknown else 'empty'}"
                                 f"; allowed: {', '.join(SEVERITIES)}")
        if not 1 <= feature_skew_severity <= 5:
            raise ValueError(f"data.feature_skew_severity must be in 1..5, got {feature_skew_severity}")
        if domain_split not in ("one", "dirichlet"):
            raise ValueError(f"data.domain_split must be one or dirichlet, got {domain_split!r}")
        if not domain_alpha > 0:
            raise ValueError(f"data.domain_alpha must be > 0, got {domain_alpha}")
        if feature_skew is not None and domain_split == "dirichlet":
            raise ValueError("data.domain_split dirichlet mixes the domains of data that has them (domainfolder); "
                             "feature-skew domains are one per client: set data.domain_split one")
        self.image_size, self.hflip, self.test_fraction = image_size, hflip, test_fraction
        self.feature_skew, self.feature_skew_severity = feature_skew, feature_skew_severity
        self.domain_split, self.domain_alpha = domain_split, domain_alpha
        self.columns = Columns(image_column, label_column, client_column, domain_column)
        self.partitioner = partitioner
        self.val_fraction = val_fraction
        self.val_indices: Optional[Tensor] = None  # the validation set's indices into the train set
        self.info = self._static_info(dataset, root)
        for key, value in (("num_clients", num_clients), ("batch_size", batch_size), ("views", views),
                           ("eval_batch_size", eval_batch_size), ("shards_per_client", shards_per_client)):
            if value is not None and value < 1:
                raise ValueError(f"data.{key} must be >= 1, got {value}")
        if batch_size is None and local_iters_per_epoch is None:
            raise ValueError("data.batch_size may be null only with data.local_iters_per_epoch set")
        if local_iters_per_epoch is not None and local_iters_per_epoch < 1:
            raise ValueError(f"data.local_iters_per_epoch must be >= 1 or null, got {local_iters_per_epoch}")
        if partition in ("dirichlet", "dirichlet_unbalanced") and not alpha > 0:
            raise ValueError(f"data.alpha must be > 0, got {alpha}")
        if channels_last not in ("auto", "on", "off"):
            raise ValueError(f"data.channels_last must be one of auto, on, off, got {channels_last!r}")
        if partition not in get_args(Partition):
            raise ValueError(f"data.partition must be one of {', '.join(get_args(Partition))}, got {partition!r}")
        self.dataset, self.root, self.download = dataset, Path(root), download
        self.num_clients, self.partition, self.alpha = num_clients, partition, alpha
        self.shards_per_client, self.seed = shards_per_client, seed
        self.batch_size, self.local_iters_per_epoch = batch_size, local_iters_per_epoch
        self.eval_batch_size, self.augment, self.views = eval_batch_size, augment, views
        self.partition_file = partition_file
        self.channels_last = channels_last
        self.memory_format = torch.channels_last if channels_last == "on" else torch.contiguous_format
        # Read now so that a malformed file stops the run before any data is loaded.
        self._file_split = None if partition_file is None else self._read_partition_file(partition_file)
        self.client_indices: list[Tensor] = []
        self.domains: Optional[list[str]] = None  # the domains' names (data with domains, or feature skew)
        self.client_domain: Optional[np.ndarray] = None  # each client's domain
        self.shifts: Optional[list[FeatureShift]] = None  # each domain's input shift (feature skew)
        self.domain_accuracy: Optional[DomainAccuracy] = None  # counts of the evaluation in progress
        self._test_ranges: list[tuple[int, int, int]] = []  # (domain, start, end) of the test set per domain
        self._eval_batch_domains: list[int] = []
        # The current round's plan, handed in by the round loop (``Federation.setup``).
        self.plan_source: Optional[Callable[[], RoundPlan]] = None

    @property
    def num_classes(self) -> int:
        return self.info.num_classes

    def _static_info(self, dataset: str, root: str) -> DatasetInfo:
        """The data set's facts: the registry's for a named one; for your own data its class count, channels and
        size, read now (mean and std, 0.5 and 0.25 until the images are loaded, then the train set's own)."""
        if not self.own_data:
            info = dataset_info(dataset)
            return info if self.hflip is None else dataclasses.replace(info, hflip=self.hflip)
        num_classes, channels, size = own_data_shape(dataset, root, self.image_size, self.columns)
        return DatasetInfo(name=dataset, num_classes=num_classes, in_channels=channels, image_size=size,
                           mean=(0.5,) * channels, std=(0.25,) * channels, crop_padding=max(1, size // 8),
                           hflip=True if self.hflip is None else self.hflip, rotation=10.0)

    def _read_partition_file(self, path: str) -> SplitFile:
        named = authors_split_name(path)
        if named is not None and (self.partition != "dirichlet" or not np.isclose(named[0], self.alpha)):
            raise ValueError(
                f"data.partition_file {path} is the authors' balanced Dirichlet split with alpha "
                f"{named[0]:g}; "
                f"set data.partition dirichlet and data.alpha {named[0]:g} (got {self.partition}, "
                f"{self.alpha:g}) so the run is labelled by the split it trains on")
        return read_split_file(path, num_clients=self.num_clients, dataset=self.dataset)

    def setup(self, stage: str) -> None:
        """Read the data once, move it to the training device and split the train set into clients;
        at ``fit``, write the split to ``<log_dir>/split.json``."""
        if not self.client_indices:
            self._load_and_split()
        if stage == "fit":
            self.export_split()

    def export_split(self) -> None:
        """Write the split to the run folder's ``split.json`` (on rank 0, when the run has a logger): at the
        start of ``fedrcl fit`` and of a Flower run's server."""
        trainer = self.trainer
        if trainer is None or not trainer.loggers:
            return
        log_dir = trainer.log_dir  # collective on several processes: every rank asks
        if trainer.is_global_zero and log_dir is not None:
            parts = self._parts  # whole, the validation samples included: the split, not what trains
            labels = label_fingerprint(self.y_train.cpu().numpy(), parts, self.num_classes)
            write_split(Path(log_dir) / "split.json", parts, self.dataset, labels)

    def _read(self) -> ImageData:
        if not self.own_data:
            return load_dataset(self.dataset, self.root, download=self.download)
        data = read_own_data(self.dataset, self.root, self.image_size, self.seed, self.test_fraction, self.columns)
        x = data.x_train.to(torch.float64).div(255.0)
        mean, std = x.mean(dim=(0, 1, 2)), x.std(dim=(0, 1, 2)).clamp_min(1e-3)
        self.info = dataclasses.replace(self.info, mean=tuple(mean.tolist()), std=tuple(std.tolist()))
        return data

    def _load_and_split(self) -> None:
        data = self._read()
        if self.partition == "natural" and data.client_train is None:
            raise ValueError(f"data.partition natural needs a natural client per sample (data.dataset leaf, or an "
                             f"npz with 'client_train'); {self.dataset} at {self.root} has none")
        if self._file_split is None and self.partitioner is not None:
            parts = self._flower_split(data)
        elif self.partition != "natural" or self._file_split is not None:
            parts = self.split(data.y_train)
        else:
            parts = self._natural_split(data)
        if self.partition == "natural" and data.client_test is not None:  # the chosen clients' own test parts
            keep = torch.isin(data.client_test, torch.as_tensor(self._natural_clients))
            data.x_test, data.y_test = data.x_test[keep], data.y_test[keep]
        self._domains_of(data, parts)
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        self.x_train, self.y_train = data.x_train.to(device), data.y_train.to(device)
        self.x_test, self.y_test = data.x_test.to(device), data.y_test.to(device)
        self.classes = data.classes
        self._choose_memory_format(device)
        if self.shifts is not None:
            self.shifts = [make_shift(s.kind, s.severity, self.info.in_channels, self.seed, d, device)
                           for d, s in enumerate(self.shifts)]
        train_parts = self._parts
        if self.val_fraction > 0:
            if self.domains is not None:
                raise ValueError(f"data.val_fraction with data that has domains ({self.dataset} at {self.root}): "
                                 f"the validation set is not evaluated per domain yet; set data.val_fraction 0")
            train_parts, held = hold_out(self._parts, self.val_fraction, self.seed)
            self.val_indices = torch.as_tensor(held, dtype=torch.long, device=device)
        self.client_indices = [torch.as_tensor(p, dtype=torch.long, device=device) for p in train_parts]
        smallest = min(range(self.num_clients), key=lambda k: len(self.client_indices[k]))
        if self.batch_size is None:
            assert self.local_iters_per_epoch is not None  # __init__: batch_size null needs local_iters_per_epoch
            self.batch_size = max(1, len(self.client_indices[smallest]) // self.local_iters_per_epoch)
        if len(self.client_indices[smallest]) < self.batch_size:
            raise ValueError(
                f"data.batch_size={self.batch_size} is larger than client {smallest}'s "
                f"{len(self.client_indices[smallest])} samples; lower batch_size or num_clients")

    def _choose_memory_format(self, device: torch.device) -> None:
        """``auto``: channels-last on the CPU, unless the model has a layer whose CPU backward breaks in it
        (``channels_last_breaks``); ``on`` with such a layer is refused before anything runs."""
        model = None if self.trainer is None else self.trainer.lightning_module
        breaks = channels_last_breaks(model) if model is not None and device.type == "cpu" else []
        if self.channels_last == "on" and breaks:
            raise ValueError(
                f"data.channels_last=on: PyTorch's CPU backward of {', '.join(breaks)} (1x1 convolutions with a "
                f"stride and fewer than 8 input channels) corrupts memory in the channels-last layout; set "
                f"data.channels_last to auto or off")
        if self.channels_last == "auto":
            self.memory_format = torch.channels_last if device.type == "cpu" and not breaks else torch.contiguous_format
            if breaks:
                rank_zero_info(f"data.channels_last auto: off, for {', '.join(breaks)} (1x1 strided convolutions "
                               f"with fewer than 8 input channels, whose CPU backward breaks in channels-last)")

    def _flower_split(self, data: ImageData) -> list[np.ndarray]:
        """``partitioner``'s split (Flower Datasets), checked like a split file."""
        assert self.partitioner is not None
        made = self.partitioner(self.num_clients)
        parts = flower_partition(made, data.y_train.numpy(),
                                 None if data.client_train is None else data.client_train.numpy(),
                                 None if data.domain_train is None else data.domain_train.numpy())
        source = f"data.partitioner {type(made).__name__}"
        if len(parts) != self.num_clients:
            raise ValueError(f"{source} made {len(parts)} partitions, data.num_clients is {self.num_clients}")
        check_split(parts, len(data.y_train), source)
        return parts

    def _natural_split(self, data: ImageData) -> list[np.ndarray]:
        """A client per natural id (a LEAF user, an npz's ``client_train``): the ``num_clients`` with the most
        training samples (ties: the smaller id)."""
        assert data.client_train is not None
        ids = data.client_train.numpy()
        counts = np.bincount(ids)
        present = np.flatnonzero(counts)
        if self.num_clients > len(present):
            raise ValueError(f"data.num_clients {self.num_clients} is more than the data's {len(present)} natural "
                             f"clients (data.partition natural); set it to {len(present)} for all of them")
        chosen = present[np.argsort(-counts[present], kind="stable")][:self.num_clients]
        self._natural_clients = [int(c) for c in chosen]
        return [np.flatnonzero(ids == c) for c in chosen]

    def _domains_of(self, data: ImageData, parts: list[np.ndarray]) -> None:
        """Domains, each client's domain and the test set's order by domain: from the data's domains (which may
        re-split the clients, ``domain_split``) or from ``feature_skew``."""
        self._parts = parts
        n_test = len(data.y_test)
        if self.feature_skew is not None:
            names = [k if self.feature_skew.count(k) == 1 else f"{k}{i}" for i, k in enumerate(self.feature_skew)]
            self.domains = names
            self.client_domain = assign_domains(self.num_clients, len(names), self.seed)
            self.shifts = [FeatureShift(k, self.feature_skew_severity) for k in self.feature_skew]
            self._test_ranges = [(d, 0, n_test) for d in range(len(names))]
        elif data.domains is not None and data.domain_train is not None and data.domain_test is not None:
            self.domains = data.domains
            if self._file_split is None and self.partition != "natural" and self.partitioner is None:
                self._parts, self.client_domain = domain_partition(
                    data.y_train.numpy(), data.domain_train.numpy(), len(data.domains), self.num_clients, self.seed,
                    self._label_split, self.domain_split, self.domain_alpha)
            order = torch.argsort(data.domain_test, stable=True)
            data.x_test, data.y_test, data.domain_test = data.x_test[order], data.y_test[order], data.domain_test[order]
            bounds = np.searchsorted(data.domain_test.numpy(), np.arange(len(data.domains) + 1))
            self._test_ranges = [(d, int(bounds[d]), int(bounds[d + 1])) for d in range(len(data.domains))
                                 if bounds[d + 1] > bounds[d]]
        else:
            self._test_ranges = [(0, 0, n_test)]
        if self.domains is not None:
            self.domain_accuracy = DomainAccuracy(self.domains, lambda i: self._eval_batch_domains[i])

    def _label_split(self, labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
        """The configured label partition of ``labels`` into ``num_clients`` (one domain's share)."""
        if self.partition == "iid":
            return iid_partition(labels, num_clients, seed=seed)
        if self.partition == "shards":
            return shard_partition(labels, num_clients, self.shards_per_client, seed=seed)
        return dirichlet_partition(labels, num_clients, self.alpha, seed=seed, balanced=self.partition == "dirichlet")

    def client_shift(self, client_id: int) -> Optional[FeatureShift]:
        """The input shift of client ``client_id``'s domain (feature skew), else None."""
        if self.shifts is None or self.client_domain is None:
            return None
        return self.shifts[int(self.client_domain[client_id])]

    def split(self, labels: Tensor) -> list[np.ndarray]:
        """One index array per client: read from ``partition_file``, or from the configured partition."""
        if self._file_split is not None:
            source = f"data.partition_file {self.partition_file}"
            check_split(self._file_split.parts, len(labels), source)
            notice = check_labels(self._file_split, labels.numpy(), self.num_classes, source)
            if notice:
                rank_zero_info(notice)
            return self._file_split.parts
        return self._label_split(labels.numpy(), self.num_clients, self.seed)

    def model_input(self, images: Tensor, generator: Optional[torch.Generator] = None,
                    train: bool = False, shift: Optional[FeatureShift] = None) -> Tensor:
        """uint8 images of this data set -> a batch of the models' input: normalised, augmented if ``train``
        (``fedrcl.data.augment.augment_batch``, drawing from ``generator``), shifted by a domain's ``shift``
        (feature skew, drawing after the augmentation), in the run's memory layout."""
        return augment_batch(images, generator, self.info, train=train, shift=shift).contiguous(
            memory_format=self.memory_format)

    def client_num_samples(self, client_id: int) -> int:
        return len(self.client_indices[client_id])

    def client_data(self, client_id: int) -> ClientSamples:
        """Client ``client_id``'s own training data, as the round hands it to the method (``ClientData``)."""
        return ClientSamples(self, client_id)

    def client_steps_per_epoch(self, client_id: int) -> int:
        if self.local_iters_per_epoch is not None:
            return self.local_iters_per_epoch
        return -(-self.client_num_samples(client_id) // self._batch_size())

    def _batch_size(self) -> int:
        assert self.batch_size is not None, "setup sets a null batch_size from local_iters_per_epoch"
        return self.batch_size

    def client_batches(self, client_id: int, round_idx: int, local_epochs: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The client's augmented training batches for one round, local epoch after local epoch."""
        indices = self.client_indices[client_id]
        n, device = len(indices), indices.device
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(seed, round_idx, client_id))
        steps, batch_size = self.client_steps_per_epoch(client_id), self._batch_size()
        shift = self.client_shift(client_id)
        for _ in range(local_epochs):
            needed = steps * batch_size if self.local_iters_per_epoch is not None else n
            order = torch.cat([torch.randperm(n, generator=gen, device=device) for _ in range(-(-needed // n))])
            order = indices[order[:needed]]
            for start in range(0, needed, batch_size):
                idx = order[start:start + batch_size]
                x = self.model_input(self.x_train[idx], gen, train=self.augment, shift=shift)
                if self.views == 1:
                    yield x, self.y_train[idx]
                else:
                    more = [self.model_input(self.x_train[idx], gen, train=self.augment, shift=shift)
                            for _ in range(self.views - 1)]
                    yield torch.cat([x, *more]), self.y_train[idx].repeat(self.views)

    def client_batch_sizes(self, client_id: int, local_epochs: int) -> tuple[int, ...]:
        """The batch size of each of the client's steps in a round (``client_batches``' batches, one view)."""
        return client_batch_sizes(self.client_num_samples(client_id), self._batch_size(), local_epochs,
                                  self.local_iters_per_epoch)

    def stacked_client_batches(self, client_ids: tuple[int, ...], round_idx: int, local_epochs: int,
                               seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The clients' batches of one round step by step, stacked on a leading client axis (``[K, B, ...]``).

        Client ``k``'s slice is exactly ``client_batches(k, ...)``'s batch of that step (its own stream). Clients
        that differ in step count or batch sizes (``local_iters_per_epoch`` null) give, per step, the batches of
        the clients that step concatenated in their ``step_mask.step_groups`` order (``[sum of rows, ...]``).
        """
        sizes = [self.client_batch_sizes(k, local_epochs) for k in client_ids]
        streams = [self.client_batches(k, round_idx, local_epochs, seed) for k in client_ids]
        if uniform(sizes):
            for batches in zip(*streams, strict=True):
                xs, ys = zip(*batches)
                yield torch.stack(xs), torch.stack(ys)
            return
        for groups, batches in zip(step_groups(sizes), itertools.zip_longest(*streams), strict=True):
            yield masked_batch(batches, groups)

    def eval_generator(self, kind: int, key: int, start: int, device: torch.device) -> torch.Generator:
        """A generator for a shift's noise outside training, the same at every evaluation: seeded by (data seed,
        ``kind`` (0: the test set of domain ``key``; 1: client ``key``'s samples), the batch's ``start``)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(self.seed, kind, key, start))
        return gen

    def eval_plan(self, rank: int = 0, world_size: int = 1) -> list[tuple[int, int, int]]:
        """The ``(domain, start, end)`` test batches this process evaluates: each domain's test samples cut by
        ``eval_slices`` (without domains: exactly ``eval_slices`` of the whole test set)."""
        if len(self._test_ranges) == 1:
            d, lo, hi = self._test_ranges[0]
            return [(d, lo + a, lo + b) for a, b in eval_slices(hi - lo, self.eval_batch_size, rank, world_size)]
        batches = [(d, lo + a, lo + b) for d, lo, hi in self._test_ranges
                   for a, b in eval_slices(hi - lo, self.eval_batch_size)]
        if len(batches) < world_size:
            raise ValueError(f"the test set's {len(batches)} batches cannot be split over {world_size} processes")
        return batches[rank * len(batches) // world_size:(rank + 1) * len(batches) // world_size]

    def train_dataloader(self) -> "RoundBatches":
        return RoundBatches(self)

    def evaluation_sets(self) -> dict[str, "EvalBatches"]:
        """What the global model is evaluated on each round, by tag prefix: with a validation split ``val`` (the
        held-out samples) and ``test``; without, ``val`` is the test set (``val/acc``, the paper's habit)."""
        if self.val_indices is None:
            return {"val": EvalBatches(self)}
        return {"val": EvalBatches(self, "val"), "test": EvalBatches(self)}

    def val_dataloader(self) -> "EvalBatches | list[EvalBatches]":
        sets = list(self.evaluation_sets().values())
        return sets[0] if len(sets) == 1 else sets

    def test_dataloader(self) -> "EvalBatches":
        return EvalBatches(self)


class ClientSamples:
    """One client's training data (``fedrcl.contract.context.ClientData``): its labels and its images as the
    model's input, read from the data module's tensors on the device, no copy kept."""

    def __init__(self, datamodule: FederatedDataModule, client_id: int):
        self._datamodule, self._indices = datamodule, datamodule.client_indices[client_id]
        self.num_classes = datamodule.num_classes
        self._client_id = client_id

    @property
    def labels(self) -> Tensor:
        return self._datamodule.y_train[self._indices]

    def batches(self, batch_size: Optional[int] = None) -> Iterator[tuple[Tensor, Tensor]]:
        """The client's samples in order, in the run's precision (``trainer.precision``: ``64-true`` gives
        float64 images, as the training batches)."""
        dm, indices = self._datamodule, self._indices
        size = batch_size or dm.eval_batch_size
        trainer = dm.trainer
        shift = dm.client_shift(self._client_id)
        for start in range(0, len(indices), size):
            idx = indices[start:start + size]
            gen = None if shift is None else dm.eval_generator(1, self._client_id, start, indices.device)
            batch = (dm.model_input(dm.x_train[idx], gen, shift=shift), dm.y_train[idx])
            yield trainer.precision_plugin.convert_input(batch) if trainer is not None else batch


def datamodule_of(trainer: L.Trainer) -> FederatedDataModule:
    """The federated data module ``trainer`` runs with (Lightning sets ``trainer.datamodule`` without declaring it)."""
    return trainer.datamodule  # type: ignore[attr-defined]


def total_train_samples(trainer: L.Trainer) -> int:
    """The training samples of every client of ``trainer``'s federation (the weights' denominator of a server
    half that counts all clients, as SCAFFOLD's and FedDyn's)."""
    dm = datamodule_of(trainer)
    return sum(dm.client_num_samples(k) for k in range(dm.num_clients))


class RoundBatches:
    """The current round's batch stream: each planned client's batches in turn (stacked when batched).

    The plan (which clients, how many steps, the seed) is the current round's, from the data module's
    ``plan_source``, which the round loop hands in at setup; Lightning re-reads ``len`` every round.
    """

    def __init__(self, datamodule: FederatedDataModule):
        self.datamodule = datamodule

    def _plan(self) -> RoundPlan:
        if self.datamodule.plan_source is None:
            raise RuntimeError("the federated data module has no round plan: train it with a FederatedTrainer")
        return self.datamodule.plan_source()

    def __len__(self) -> int:
        return self._plan().total_steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        plan = self._plan()
        seed = plan.seed
        if plan.remote:
            yield TrainedElsewhere()  # type: ignore[misc]  # not a batch: the round's clients train elsewhere
            return
        if plan.batched:
            yield from self.datamodule.stacked_client_batches(plan.client_ids, plan.round_idx, plan.local_epochs,
                                                              seed)
            return
        for client_id in plan.client_ids:
            yield from self.datamodule.client_batches(client_id, plan.round_idx, plan.local_epochs, seed)


def eval_slices(num_samples: int, batch_size: int, rank: int = 0,
                world_size: int = 1) -> list[tuple[int, int]]:
    """The ``(start, end)`` test-set batches that process ``rank`` of ``world_size`` evaluates.

    The test set is cut into batches of ``batch_size`` as on one process, and each process takes a
    near-equal contiguous run of them, so every sample is evaluated once, in the same batch as on one
    process. With fewer batches than processes each process takes one near-equal contiguous slice instead
    (then batch boundaries differ from one process's).
    """
    if num_samples < world_size:
        raise ValueError(f"the test set's {num_samples} samples cannot be split over {world_size} processes")
    batches = [(start, min(start + batch_size, num_samples)) for start in range(0, num_samples, batch_size)]
    if len(batches) < world_size:
        return [(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)]
    return batches[rank * len(batches) // world_size:(rank + 1) * len(batches) // world_size]


class EvalBatches:
    """The test set (or with ``split="val"`` the validation set) in order, normalised, in batches of
    ``eval_batch_size``; with several processes, this process's share (``eval_slices``), so that metrics synced
    over processes see every sample once."""

    def __init__(self, datamodule: FederatedDataModule, split: Literal["test", "val"] = "test"):
        self.datamodule, self.split = datamodule, split

    def _slices(self) -> list[tuple[int, int, int]]:
        dm, trainer = self.datamodule, self.datamodule.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if self.split == "val":
            assert dm.val_indices is not None, "a validation set is evaluated only with data.val_fraction > 0"
            return [(0, a, b) for a, b in eval_slices(len(dm.val_indices), dm.eval_batch_size, rank, world_size)]
        if not dm._test_ranges:  # not set up by ``setup`` (a test building the data module by hand)
            dm._test_ranges = [(0, 0, len(dm.y_test))]
        return dm.eval_plan(rank, world_size)

    def __len__(self) -> int:
        return len(self._slices())

    @property
    def num_samples(self) -> int:
        """The samples of the whole set (over all processes)."""
        dm = self.datamodule
        return len(dm.val_indices) if self.split == "val" and dm.val_indices is not None else len(dm.y_test)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        dm = self.datamodule
        plan = self._slices()
        if self.split == "val":
            assert dm.val_indices is not None
            for _, start, end in plan:
                idx = dm.val_indices[start:end]
                yield dm.model_input(dm.x_train[idx]), dm.y_train[idx]
            return
        dm._eval_batch_domains = [d for d, _, _ in plan]  # read by ``DomainAccuracy`` per batch index
        for d, start, end in plan:
            shift = None if dm.shifts is None else dm.shifts[d]
            gen = None if shift is None else dm.eval_generator(0, d, start, dm.x_test.device)
            yield dm.model_input(dm.x_test[start:end], gen, shift=shift), dm.y_test[start:end]
