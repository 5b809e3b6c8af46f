import dataclasses
import itertools

import pytest
import torch

from fedrcl.data.augment import augment_batch, to_normalized
from fedrcl.data.datasets import dataset_info

CIFAR = dataset_info("cifar10")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _images(b=16, h=32, w=32, c=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, h, w, c), generator=g, dtype=torch.uint8).to(device)


def _gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def _plain(images, info):
    mean = torch.tensor(info.mean, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(info.std, device=images.device).view(1, -1, 1, 1)
    return (images.permute(0, 3, 1, 2).float() / 255 - mean) / std


def _unnorm(x, info):
    mean = torch.tensor(info.mean, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(info.std, device=x.device).view(1, -1, 1, 1)
    return x * std + mean  # back to [0, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [True, False])
def test_shape_dtype_device(device, train):
    imgs = _images(device=device)
    out = augment_batch(imgs, _gen(0, device), CIFAR, train=train)
    assert out.shape == (16, 3, 32, 32)
    assert out.dtype == torch.float32
    assert out.device.type == device
    assert out.is_contiguous()
    assert torch.isfinite(out).all()


def test_eval_is_plain_normalisation():
    imgs = _images()
    expect = _plain(imgs, CIFAR)
    assert torch.equal(augment_batch(imgs, _gen(0), CIFAR, train=False), expect)
    assert torch.equal(to_normalized(imgs, CIFAR), expect)


def test_flip_only_gives_flip_or_identity():
    info = dataclasses.replace(CIFAR, rotation=0.0, crop_padding=0, hflip=True)
    imgs = _images(b=64)
    x = imgs.permute(0, 3, 1, 2).float() / 255
    out = _unnorm(augment_batch(imgs, _gen(1), info, train=True), info)
    flipped = 0
    for i in range(len(imgs)):
        if torch.allclose(out[i], x[i], atol=1e-4):
            continue
        assert torch.allclose(out[i], x[i].flip(-1), atol=1e-4), f"sample {i} neither flipped nor identity"
        flipped += 1
    assert 10 < flipped < 54  # about half, p(outside) ~ 1e-7


def test_no_flip_when_disabled():
    info = dataclasses.replace(CIFAR, rotation=0.0, crop_padding=0, hflip=False)
    imgs = _images(b=32)
    out = _unnorm(augment_batch(imgs, _gen(1), info, train=True), info)
    assert torch.allclose(out, imgs.permute(0, 3, 1, 2).float() / 255, atol=1e-4)


def _shifted(img, dx, dy):
    """out[y, x] = img[y + dy, x + dx], zero outside; img is [C, H, W]."""
    _, h, w = img.shape
    out = torch.roll(img, shifts=(-dy, -dx), dims=(1, 2)).clone()
    if dy > 0:
        out[:, h - dy:, :] = 0
    elif dy < 0:
        out[:, :-dy, :] = 0
    if dx > 0:
        out[:, :, w - dx:] = 0
    elif dx < 0:
        out[:, :, :-dx] = 0
    return out


def test_integer_shift_with_zero_fill():
    p = 4
    info = dataclasses.replace(CIFAR, rotation=0.0, crop_padding=p, hflip=False)
    imgs = _images(b=32, seed=3)
    # avoid black pixels so that the zero border is unambiguous
    imgs = imgs.clamp(min=1)
    x = imgs.permute(0, 3, 1, 2).float() / 255
    out = _unnorm(augment_batch(imgs, _gen(7), info, train=True), info)
    shifts = []
    for i in range(len(imgs)):
        match = [
            (dx, dy)
            for dx, dy in itertools.product(range(-p, p + 1), repeat=2)
            if torch.allclose(out[i], _shifted(x[i], dx, dy), atol=1e-4)
        ]
        assert len(match) == 1, f"sample {i}: no integer shift in [-{p}, {p}] reproduces it"
        shifts.append(match[0])
    assert len(set(shifts)) > 10
    assert any(dx != 0 and dy != 0 for dx, dy in shifts)
    assert max(max(abs(dx), abs(dy)) for dx, dy in shifts) == p


def test_same_seed_same_output_different_seed_different():
    imgs = _images()
    a = augment_batch(imgs, _gen(5), CIFAR, train=True)
    b = augment_batch(imgs, _gen(5), CIFAR, train=True)
    c = augment_batch(imgs, _gen(6), CIFAR, train=True)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_samples_get_different_transforms():
    # the same image repeated: every copy should come out differently
    one = _images(b=1)
    imgs = one.expand(16, -1, -1, -1).contiguous()
    out = augment_batch(imgs, _gen(0), CIFAR, train=True)
    flat = out.flatten(1)
    dists = torch.cdist(flat, flat)
    off_diag = dists[~torch.eye(16, dtype=torch.bool)]
    assert (off_diag > 1e-3).all()


def test_rotation_changes_pixels_but_keeps_centre():
    info = dataclasses.replace(CIFAR, rotation=10.0, crop_padding=0, hflip=False)
    imgs = _images(b=8)
    x = imgs.permute(0, 3, 1, 2).float() / 255
    out = _unnorm(augment_batch(imgs, _gen(2), info, train=True), info)
    assert not torch.allclose(out, x, atol=1e-2)
    # a small rotation about the centre moves pixels near the corners more than near the middle
    err = (out - x).abs().mean(dim=(0, 1))
    assert err[14:18, 14:18].mean() < err[:4, :4].mean()


def test_single_channel_digits():
    info = dataset_info("digits")
    imgs = _images(b=8, h=8, w=8, c=1)
    out = augment_batch(imgs, _gen(0), info, train=True)
    assert out.shape == (8, 1, 8, 8)


def test_bad_inputs():
    with pytest.raises(ValueError, match="uint8"):
        augment_batch(_images().float(), _gen(0), CIFAR, train=True)
    with pytest.raises(ValueError, match="channels"):
        augment_batch(_images(c=1), _gen(0), CIFAR, train=True)
