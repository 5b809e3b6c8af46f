"""Hugging Face data sets on disk and Flower Datasets' partitioners (the ``data`` extra): a tiny data set saved with
``save_to_disk`` trains 2 rounds, resumes bitwise and is reported; Flower's Dirichlet partitioner through fedrcl
gives the split Flower Datasets itself gives for the same seed, written to split.json."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pytest
from flwr_datasets.partitioner import DirichletPartitioner
from PIL import Image

from conftest import run_cli
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.datasets import load_dataset
from fedrcl.data.sources import read_own_data

from test_data_sources import class_images, fit_resume_report


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    features = datasets.Features({"img": datasets.Image(), "fine": datasets.ClassLabel(names=["x", "y", "z"]),
                                  "writer": datasets.Value("string")})

    def split(n: int, seed: int) -> datasets.Dataset:
        x, y = class_images(n, size=10, seed=seed)
        return datasets.Dataset.from_dict({"img": [Image.fromarray(im) for im in x], "fine": y.tolist(),
                                           "writer": [f"w{i % 5}" for i in range(len(y))]}, features=features)

    root = tmp_path_factory.mktemp("hf") / "tiny"
    datasets.DatasetDict({"train": split(30, 0), "test": split(6, 1)}).save_to_disk(str(root))
    return root


HF = ("--data.dataset", "huggingface", "--data.image_column", "img", "--data.label_column", "fine")


def test_a_saved_hugging_face_data_set_trains_resumes_and_is_reported(hf_folder, tmp_path, capsys):
    curves = fit_resume_report((HF[0], HF[1], "--data.root", str(hf_folder), *HF[2:]), tmp_path, capsys)
    assert list(curves["val/acc"][0]) == [1, 2]


def test_columns_name_the_classes_and_a_natural_client(hf_folder):
    data = read_own_data("huggingface", hf_folder, columns=FederatedDataModule(
        "huggingface", str(hf_folder), image_column="img", label_column="fine").columns)
    assert data.classes == ["x", "y", "z"] and data.x_train.shape == (90, 10, 10, 3)
    dm = FederatedDataModule("huggingface", str(hf_folder), num_clients=5, batch_size=4, image_column="img",
                             label_column="fine", client_column="writer", partition="natural")
    dm.setup("validate")
    assert [len(p) for p in dm.client_indices] == [18] * 5  # one client per writer


def test_a_missing_column_is_one_line_naming_it(hf_folder):
    with pytest.raises(ValueError, match=r"the train split has no column 'label' \(data.label_column; columns: img"):
        FederatedDataModule("huggingface", str(hf_folder), image_column="img")


def flower_split(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Flower Datasets' own: its Dirichlet partitioner over a data set of the labels, partition by partition."""
    ds = datasets.Dataset.from_dict({"label": labels.tolist(), "row": list(range(len(labels)))})
    part = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=0.3, seed=seed)
    part.dataset = ds
    return [np.sort(np.asarray(part.load_partition(k)["row"])) for k in range(num_partitions)]


def test_flowers_dirichlet_partitioner_gives_flowers_split_on_the_digits(data_root, tmp_path):
    labels = load_dataset("digits", data_root).y_train.numpy()
    expected = flower_split(labels, 10, seed=7)
    dm = FederatedDataModule("digits", str(data_root), num_clients=10, batch_size=4,
                             partitioner=partial(DirichletPartitioner, partition_by="label", alpha=0.3, seed=7))
    dm.setup("validate")
    assert [p.tolist() for p in dm.client_indices] == [p.tolist() for p in expected]
    assert len({len(p) for p in expected}) > 1  # unequal sizes: Flower's Dirichlet, not fedrcl's balanced one
    cli = run_cli(data_root, tmp_path, "--data.partitioner", "flwr_datasets.partitioner.DirichletPartitioner",
                  "--data.partitioner.init_args.partition_by", "label", "--data.partitioner.init_args.alpha", "0.3",
                  "--data.partitioner.init_args.seed", "7", "--data.batch_size", "4", rounds=1,
                  model="fedrcl.algorithms.FedAvg")
    written = json.loads((Path(cli.trainer.logger.log_dir) / "split.json").read_text())
    assert written["clients"] == [p.tolist() for p in expected]
