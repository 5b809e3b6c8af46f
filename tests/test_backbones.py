"""The other backbones of the FedRCL paper's supplement Table C: VGG9, MobileNetV2, ShuffleNetV1, SqueezeNet."""
from __future__ import annotations

import inspect
import typing

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from conftest import REPO, run_cli
from fedrcl.cli import main
from fedrcl.algorithms.fedmlb import forward_from, forward_with_maps
from fedrcl.models import MobileNetV2, ModelOutput, ShuffleNetV1, SqueezeNet, VGG9

# class -> documented feature_dims
DIMS = {
    VGG9: [32, 64, 128, 128, 256, 256],
    MobileNetV2: [32, 16, 24, 32, 64, 96, 160],
    ShuffleNetV1: [24, 240, 480, 960],
    SqueezeNet: [96, 128, 256, 384, 512],
}
CLASSES = list(DIMS)
IDS = [c.__name__ for c in CLASSES]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("image_size", "in_channels"), [(32, 3), (64, 3), (8, 1)])
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_levels_have_documented_shapes(cls, image_size: int, in_channels: int) -> None:
    torch.manual_seed(0)
    model = cls(num_classes=7, in_channels=in_channels, image_size=image_size)
    assert model.feature_dims == DIMS[cls]
    with torch.no_grad():
        out = model(torch.randn(2, in_channels, image_size, image_size))
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 7)
    assert [tuple(f.shape) for f in out.features] == [(2, c) for c in DIMS[cls]]
    assert all(torch.isfinite(f).all() for f in [out.logits, *out.features])


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_groupnorm_with_two_groups_everywhere(cls) -> None:
    model = cls(num_classes=100)
    mods = list(model.modules())
    assert not any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm))
                   for m in mods)
    gns = [m for m in mods if isinstance(m, nn.GroupNorm)]
    convs = [m for m in mods if isinstance(m, nn.Conv2d)]
    assert len(gns) == len(convs) > 0  # every conv is normalised
    assert all(g.num_groups == 2 and g.num_channels % 2 == 0 for g in gns)
    assert all(torch.all(g.weight == 1) and torch.all(g.bias == 0) for g in gns)
    assert isinstance(model.fc, nn.Linear) and model.fc.out_features == 100


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_features_are_pre_activation(cls) -> None:
    torch.manual_seed(0)
    model = cls(num_classes=10)
    with torch.no_grad():
        out = model(torch.randn(4, 3, 32, 32))
    # A global average of a rectified map is never negative: every documented tap is signed.
    for level, f in enumerate(out.features):
        assert (f < 0).any(), f"level {level} has no negative entry"


def _gap(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=(2, 3))


def test_vgg9_taps_match_hand_computation() -> None:
    torch.manual_seed(0)
    model = VGG9(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        convs = [b[0] for b in model.blocks]
        norms = [b[1] for b in model.blocks]
        pres, h = [], x
        for i in range(6):
            if i in (2, 4):
                h = F.max_pool2d(h, 2)
            pre = norms[i](convs[i](h))
            pres.append(pre)
            h = torch.relu(pre)
        h = F.max_pool2d(h, 2).flatten(1)  # 32 px: 4x4 after three pools, 4096 values
        logits = model.fc(torch.relu(model.fc2(torch.relu(model.fc1(h)))))
    for got, pre in zip(out.features, pres):
        torch.testing.assert_close(got, _gap(pre))
    torch.testing.assert_close(out.logits, logits)


def test_mobilenetv2_taps_match_hand_computation() -> None:
    torch.manual_seed(0)
    model = MobileNetV2(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        stem = model.stem[1](model.stem[0](x))
        assert stem.shape[-1] == 34  # the release's 1x1 stem conv with padding 1
        h, pres = F.relu6(stem), [stem]
        for stage in model.stages:
            for block in stage:
                y = block.project(F.relu6(block.depthwise(F.relu6(block.expand(h)))))
                h = y + h if block.residual else y
            pres.append(h)  # linear bottleneck: no activation after a stage
        h = F.relu6(model.last_conv(model.last_stage(h)))
        logits = model.fc(h.mean(dim=(2, 3)))
    assert [b.residual for b in model.stages[1]] == [False, True]
    for got, pre in zip(out.features, pres):
        torch.testing.assert_close(got, _gap(pre))
    torch.testing.assert_close(out.logits, logits)


def test_shufflenet_taps_match_hand_computation() -> None:
    torch.manual_seed(0)
    model = ShuffleNetV1(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        pre = model.stem(x)
        pres, h = [pre], torch.relu(pre)
        for stage in model.stages:
            for unit in stage:
                b = torch.relu(unit.compress(h))
                n, c, hh, ww = b.shape
                b = b.view(n, 3, c // 3, hh, ww).transpose(1, 2).reshape(n, c, hh, ww)
                b = unit.expand(unit.depthwise(b))
                pre = torch.cat([F.avg_pool2d(h, 3, 2, 1), b], 1) if unit.stride == 2 else b + h
                h = torch.relu(pre)
            pres.append(pre)
        logits = model.fc(h.mean(dim=(2, 3)))
    assert [u.stride for u in model.stages[1]] == [2] + [1] * 7
    assert pres[-1].shape[-1] == 4
    for got, pre in zip(out.features, pres):
        torch.testing.assert_close(got, _gap(pre))
    torch.testing.assert_close(out.logits, logits)


def test_squeezenet_taps_match_hand_computation() -> None:
    torch.manual_seed(0)
    model = SqueezeNet(num_classes=10)
    x = torch.randn(2, 3, 32, 32)

    def fire_pre(fire, t):
        s = torch.relu(fire.squeeze(t))
        return torch.cat([fire.expand1x1(s), fire.expand3x3(s)], 1)

    def fire(f, t):
        return torch.relu(fire_pre(f, t))

    with torch.no_grad():
        out = model(x)
        stem = model.stem(x)
        f1 = F.max_pool2d(torch.relu(stem), 2)
        p2 = fire_pre(model.fire2, f1)
        f2 = torch.relu(p2)
        f3 = fire(model.fire3, f2) + f2
        p4 = fire_pre(model.fire4, f3)
        f4 = F.max_pool2d(torch.relu(p4), 2)
        f5 = fire(model.fire5, f4) + f4
        p6 = fire_pre(model.fire6, f5)
        f6 = torch.relu(p6)
        f7 = fire(model.fire7, f6) + f6
        p8 = fire_pre(model.fire8, f7)
        f8 = F.max_pool2d(torch.relu(p8), 2)
        logits = model.fc(fire(model.fire9, f8).mean(dim=(2, 3)))
    for got, pre in zip(out.features, [stem, p2, p4, p6, p8]):
        torch.testing.assert_close(got, _gap(pre))
    torch.testing.assert_close(out.logits, logits)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_level_by_level_reproduces_forward(cls) -> None:
    """FedMLB's stepping (``forward_level``, activation, ``forward_head``) is ``forward``, bit for bit."""
    torch.manual_seed(0)
    model = cls(num_classes=10)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        stepped, maps = forward_with_maps(model, x)
        assert torch.equal(stepped.logits, out.logits)
        assert all(torch.equal(a, b) for a, b in zip(stepped.features, out.features))
        assert len(maps) == len(model.feature_dims)
        for level, h in enumerate(maps):
            assert torch.equal(forward_from(model, level, h), out.logits)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_train_step_updates_every_weight(cls) -> None:
    torch.manual_seed(0)
    model = cls(num_classes=10)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    out = model(x)
    loss = F.cross_entropy(out.logits, y) + sum(f.pow(2).mean() for f in out.features)
    opt.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_constructor_signature_is_typed_and_documented(cls) -> None:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params[:3]] == ["num_classes", "in_channels", "image_size"]
    assert params[1].default == 3 and params[2].default == 32
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)  # no **kwargs swallowing unknown keys
    hints = typing.get_type_hints(cls.__init__)
    doc = cls.__doc__ or ""
    assert "Args:" in doc
    for p in params:
        assert hints.get(p.name) is int and f"{p.name}:" in doc


@pytest.mark.parametrize(
    "factory",
    [lambda: VGG9(10, image_size=4), lambda: SqueezeNet(10, image_size=7), lambda: VGG9(10, norm_groups=3),
     lambda: MobileNetV2(10, norm_groups=3), lambda: ShuffleNetV1(10, norm_groups=7),
     lambda: ShuffleNetV1(10, groups=5),
     lambda: SqueezeNet(10, norm_groups=5), lambda: MobileNetV2(0)],
    ids=["vgg-size", "squeeze-size", "vgg-groups", "mobile-groups", "shuffle-norm", "shuffle-groups", "squeeze-groups",
         "mobile-classes"],
)
def test_invalid_arguments_raise(factory) -> None:
    with pytest.raises(ValueError):
        factory()


def test_shufflenet_group_variants() -> None:
    for groups, width in ((1, 144), (2, 200), (4, 272), (8, 384)):
        model = ShuffleNetV1(10, groups=groups)
        assert model.feature_dims == [24, width, 2 * width, 4 * width]
        with torch.no_grad():
            assert model(torch.randn(1, 3, 16, 16)).logits.shape == (1, 10)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_one_round_through_the_cli(cls, data_root, tmp_path) -> None:
    """Digits are 8x8 grey: every backbone takes them (VGG9 and SqueezeNet need at least 8 px)."""
    cli = run_cli(data_root, tmp_path, "--model.init_args.backbone.class_path", f"fedrcl.models.{cls.__name__}",
                  "--data.num_clients", "20", rounds=1)
    assert type(cli.model.backbone) is cls
    assert cli.model.backbone.in_channels == 1 and cli.model.backbone.image_size == 8
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.current_epoch == 1
    assert torch.isfinite(metrics["train/loss"]) and 0.0 <= metrics["val/acc"].item() <= 1.0


def test_fedmlb_with_mobilenetv2_through_the_cli(data_root, tmp_path) -> None:
    """MobileNetV2's stages end without an activation: FedMLB must hand them on unrectified."""
    cli = run_cli(data_root, tmp_path, "--model.init_args.backbone.class_path", "fedrcl.models.MobileNetV2",
                  "--data.num_clients", "20", rounds=1, model="fedrcl.algorithms.FedMLB")
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss_hybrid_ce"]) and torch.isfinite(metrics["train/loss_hybrid_kd"])


def _print_config(capsys, *configs: str) -> dict:
    args = ["fit"]
    for c in configs:
        args += ["--config", str(REPO / "configs" / c)]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)["model"]


TABLE_C = [("vgg9", "VGG9", 1.0), ("mobilenetv2", "MobileNetV2", 2.0), ("shufflenet", "ShuffleNetV1", 1.0),
           ("squeezenet", "SqueezeNet", 1.0)]


@pytest.mark.parametrize(("stem", "cls", "beta"), TABLE_C)
def test_table_c_configs_compose(stem: str, cls: str, beta: float, capsys) -> None:
    """Supplement Table C: CIFAR-100 alpha 0.3 with another backbone; beta 2 for MobileNet, 1 for the rest."""
    model = _print_config(capsys, "cifar100_a03.yaml", f"backbones/{stem}.yaml")
    assert model["class_path"] == "fedrcl.algorithms.FedRCL"
    assert model["init_args"]["backbone"]["class_path"] == f"fedrcl.models.{cls}"
    assert model["init_args"]["beta"] == beta
    # a method file after it keeps the backbone (and drops beta where the method has none)
    model = _print_config(capsys, "cifar100_a03.yaml", f"backbones/{stem}.yaml", "methods/fedmlb.yaml")
    assert model["class_path"] == "fedrcl.algorithms.FedMLB" and "beta" not in model["init_args"]
    assert model["init_args"]["backbone"]["class_path"] == f"fedrcl.models.{cls}"
