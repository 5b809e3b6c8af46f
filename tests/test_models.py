"""Tests for the backbones in fedrcl.models (ResNet18 with GroupNorm, SmallCNN)."""

import pytest
import torch
from torch import nn

from fedrcl.models.cnn import SmallCNN
from fedrcl.models.output import ModelOutput
from fedrcl.models.resnet import ResNet18


def _check_output(model: nn.Module, out: ModelOutput, batch: int, num_classes: int) -> None:
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (batch, num_classes)
    assert len(out.features) == len(model.feature_dims)
    for f, c in zip(out.features, model.feature_dims):
        assert f.shape == (batch, c)
        assert torch.isfinite(f).all()


@pytest.mark.parametrize("width", [8, 64])
@pytest.mark.parametrize("image_size", [32, 64])
@pytest.mark.parametrize("in_channels", [1, 3])
def test_resnet18_levels_and_shapes(width: int, image_size: int, in_channels: int) -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, in_channels=in_channels, image_size=image_size, width=width)
    assert model.feature_dims == [width, width, 2 * width, 4 * width, 8 * width]
    x = torch.randn(2, in_channels, image_size, image_size)
    with torch.no_grad():
        out = model(x)
    assert len(out.features) == 5
    _check_output(model, out, batch=2, num_classes=10)


@pytest.mark.parametrize(("image_size", "padding"), [(32, 0), (8, 2)])
@pytest.mark.parametrize("in_channels", [1, 3])
def test_smallcnn_levels_and_shapes(image_size: int, padding: int, in_channels: int) -> None:
    torch.manual_seed(0)
    model = SmallCNN(num_classes=7, in_channels=in_channels, image_size=image_size, conv_padding=padding)
    assert model.feature_dims == [32, 64, 384, 192]
    x = torch.randn(3, in_channels, image_size, image_size)
    with torch.no_grad():
        out = model(x)
    assert len(out.features) == 4
    _check_output(model, out, batch=3, num_classes=7)


def test_smallcnn_flatten_size() -> None:
    assert SmallCNN(10).flat_size == 64 * 5 * 5
    assert SmallCNN(10, in_channels=1, image_size=8, conv_padding=2).flat_size == 64 * 2 * 2


@pytest.mark.parametrize(("image_size", "padding"), [(8, 0), (12, 0), (2, 0), (1, 2)])
def test_smallcnn_vanishing_spatial_size_raises(image_size: int, padding: int) -> None:
    with pytest.raises(ValueError, match="image_size.*conv_padding"):
        SmallCNN(10, image_size=image_size, conv_padding=padding)


def test_smallcnn_smallest_valid_size_builds() -> None:
    # 16 px, no padding: 16 -> 12 -> 6 -> 2 -> 1
    model = SmallCNN(10, image_size=16)
    assert model.flat_size == 64
    with torch.no_grad():
        assert model(torch.randn(1, 3, 16, 16)).logits.shape == (1, 10)


@pytest.mark.parametrize(
    "factory",
    [lambda: ResNet18(num_classes=10, width=8), lambda: SmallCNN(num_classes=10)],
    ids=["resnet18", "smallcnn"],
)
def test_features_are_pre_relu(factory) -> None:
    torch.manual_seed(0)
    model = factory()
    with torch.no_grad():
        out = model(torch.randn(4, 3, 32, 32))
    # A global average of a post-ReLU map is never negative; pre-ReLU features must be.
    assert any((f < 0).any() for f in out.features)


def test_resnet_stem_feature_matches_hand_computation() -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, width=8)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        expected = model.bn1(model.conv1(x)).mean(dim=(2, 3))
    assert torch.allclose(out.features[0], expected, atol=1e-6)
    assert (expected < 0).any()


def test_resnet_last_stage_feature_matches_hand_computation() -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, width=8)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        h = torch.relu(model.bn1(model.conv1(x)))
        h = model.layer3(model.layer2(model.layer1(h)))
        h = model.layer4[0](h)
        blk = model.layer4[1]
        pre = blk.bn2(blk.conv2(torch.relu(blk.bn1(blk.conv1(h))))) + h
        logits = model.fc(torch.relu(pre).mean(dim=(2, 3)))
    assert torch.allclose(out.features[4], pre.mean(dim=(2, 3)), atol=1e-5)
    assert torch.allclose(out.logits, logits, atol=1e-5)


def test_smallcnn_features_match_hand_computation() -> None:
    torch.manual_seed(0)
    model = SmallCNN(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        c1 = model.conv1(x)
        c2 = model.conv2(nn.functional.max_pool2d(torch.relu(c1), 2))
        f1 = model.fc1(nn.functional.max_pool2d(torch.relu(c2), 2).flatten(1))
        f2 = model.fc2(torch.relu(f1))
    for got, want in zip(out.features, [c1.mean(dim=(2, 3)), c2.mean(dim=(2, 3)), f1, f2]):
        assert torch.allclose(got, want, atol=1e-5)
    assert (f1 < 0).any() and (f2 < 0).any()


@pytest.mark.parametrize("width", [8, 64])
def test_resnet_groupnorm_everywhere(width: int) -> None:
    model = ResNet18(num_classes=100, width=width)
    mods = list(model.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in mods)
    assert not any(isinstance(m, (nn.MaxPool2d, nn.AdaptiveMaxPool2d)) for m in mods)
    gns = [m for m in mods if isinstance(m, nn.GroupNorm)]
    # stem + 2 per block * 8 blocks + 3 downsample paths
    assert len(gns) == 1 + 16 + 3
    assert all(g.num_groups == 2 for g in gns)
    assert all(torch.all(g.weight == 1) and torch.all(g.bias == 0) for g in gns)
    downsamples = [blk.downsample for stage in (model.layer2, model.layer3, model.layer4) for blk in stage[:1]]
    for ds in downsamples:
        assert any(isinstance(m, nn.GroupNorm) for m in ds.modules())
        assert any(isinstance(m, nn.Conv2d) and m.stride == (2, 2) and m.kernel_size == (1, 1) for m in ds.modules())
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and model.conv1.bias is None
    assert model.fc.bias is not None


def test_resnet_norm_groups_argument() -> None:
    model = ResNet18(num_classes=10, width=8, norm_groups=4)
    assert all(m.num_groups == 4 for m in model.modules() if isinstance(m, nn.GroupNorm))
    with pytest.raises(ValueError):
        ResNet18(num_classes=10, width=6, norm_groups=4)


def test_resnet_parameter_count() -> None:
    def count(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    n64 = count(ResNet18(num_classes=100, width=64))
    n8 = count(ResNet18(num_classes=100, width=8))
    assert 11_000_000 <= n64 <= 11_400_000
    assert n8 < n64 / 30


@pytest.mark.parametrize(
    ("factory", "in_channels", "image_size"),
    [
        (lambda: ResNet18(num_classes=10, width=8), 3, 32),
        (lambda: ResNet18(num_classes=10, in_channels=1, image_size=64, width=8), 1, 64),
        (lambda: SmallCNN(num_classes=10), 3, 32),
        (lambda: SmallCNN(num_classes=10, in_channels=1, image_size=8, conv_padding=2), 1, 8),
    ],
    ids=["resnet18-32", "resnet18-64-gray", "smallcnn-32", "smallcnn-8"],
)
def test_train_step_updates_weights(factory, in_channels: int, image_size: int) -> None:
    torch.manual_seed(0)
    model = factory()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, in_channels, image_size, image_size)
    y = torch.randint(0, 10, (4,))
    out = model(x)
    loss = nn.functional.cross_entropy(out.logits, y)
    opt.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    opt.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert any(changed)
    # every weight tensor receives a gradient and moves (none is dead code)
    assert all(changed)


def test_features_carry_gradient() -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, width=8)
    out = model(torch.randn(2, 3, 32, 32))
    out.features[0].sum().backward()
    assert model.conv1.weight.grad is not None and model.conv1.weight.grad.abs().sum() > 0
    assert model.fc.weight.grad is None


def test_constructor_signatures_are_typed_and_documented() -> None:
    import inspect
    import typing

    for cls in (ResNet18, SmallCNN):
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert [p.name for p in params[:3]] == ["num_classes", "in_channels", "image_size"]
        assert params[1].default == 3 and params[2].default == 32
        hints = typing.get_type_hints(cls.__init__)
        doc = cls.__doc__ or ""
        assert "Args:" in doc
        for p in params:
            assert hints.get(p.name) is int
            assert f"{p.name}:" in doc
