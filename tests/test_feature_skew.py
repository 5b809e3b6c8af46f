"""Feature skew: each shift pinned to its definition (hand cases, random cases against a float64 reference), the
labels' split unchanged, batches bitwise reproducible, the test set evaluated under every shift."""
from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrcl.data import feature_skew as fs
from fedrcl.data.datamodule import EvalBatches, FederatedDataModule

from test_data_sources import fit_resume_report


def test_contrast_brightness_colour_shift_and_pixelate_by_hand():
    x = torch.tensor([0.2, 0.6]).view(1, 1, 1, 2)
    assert fs.contrast(x, 0.5).flatten().tolist() == pytest.approx([0.3, 0.5])  # mean 0.4
    rgb = torch.tensor([[0.2, 0.0], [0.4, 0.0], [0.1, 0.0]]).view(1, 3, 1, 2)  # a pixel and a black one
    out = fs.brightness(rgb, 0.1).view(3, 2)
    assert out[:, 0].tolist() == pytest.approx([0.25, 0.5, 0.125])  # V 0.4 -> 0.5: scaled by 1.25
    assert out[:, 1].tolist() == pytest.approx([0.1, 0.1, 0.1])  # black -> grey V'
    shifted = fs.colour_shift(torch.full((1, 2, 1, 1), 0.95), torch.tensor([0.1, -0.2]))
    assert shifted.flatten().tolist() == pytest.approx([1.0, 0.75])
    x = torch.arange(16.0).view(1, 1, 4, 4)
    assert fs.pixelate(x, 0.5)[0, 0].tolist() == [[2.5, 2.5, 4.5, 4.5], [2.5, 2.5, 4.5, 4.5],
                                                  [10.5, 10.5, 12.5, 12.5], [10.5, 10.5, 12.5, 12.5]]
    assert torch.equal(fs.rotate(x, 90), torch.rot90(x, 1, (2, 3)))  # counter-clockwise
    k = fs.gaussian_kernel(0.4, torch.float64)
    assert len(k) == 5 and k.sum().item() == pytest.approx(1.0)  # radius int(4 * 0.4 + 0.5) = 2


def test_brightness_is_hsv_value_plus_delta_on_random_pixels():
    x = torch.rand(2, 3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = fs.brightness(x, 0.15)
    for b, i, j in np.ndindex(2, 4, 5):
        h, s, v = colorsys.rgb_to_hsv(*x[b, :, i, j].tolist())
        expected = colorsys.hsv_to_rgb(h, s, min(v + 0.15, 1.0))
        assert out[b, :, i, j].tolist() == pytest.approx(expected, abs=1e-12)


def test_gaussian_blur_is_scipys_with_nearest_edges():
    from scipy.ndimage import gaussian_filter

    x = torch.rand(2, 3, 9, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for sigma in (0.4, 0.7, 1.0):
        expected = gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="nearest", truncate=4.0)
        np.testing.assert_allclose(fs.gaussian_blur(x, sigma).numpy(), expected, atol=1e-12)


def test_noise_shifts_draw_from_the_given_generator_with_their_severitys_size():
    x = torch.full((4, 3, 32, 32), 0.5)

    def draw(kind):
        return fs.make_shift(kind, 5, 3, seed=0, domain=0)(x, torch.Generator().manual_seed(7))

    for kind in ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise"):
        assert torch.equal(draw(kind), draw(kind)), kind
    assert (draw("gaussian_noise") - 0.5).std().item() == pytest.approx(0.10, rel=0.05)
    hit = draw("impulse_noise") != 0.5
    assert hit.float().mean().item() == pytest.approx(0.07, rel=0.15)
    assert set(draw("impulse_noise")[hit].unique().tolist()) == {0.0, 1.0}
    assert (draw("shot_noise") * 50).sub((draw("shot_noise") * 50).round()).abs().max() < 1e-4  # k / rate


def test_a_domains_fixed_parameters_are_seeded_per_domain():
    a, b = (fs.make_shift("colour_shift", 2, 3, seed=0, domain=d) for d in (0, 1))
    assert a.offset is not None and b.offset is not None and not torch.equal(a.offset, b.offset)
    assert torch.equal(a.offset, fs.make_shift("colour_shift", 2, 3, seed=0, domain=0).offset)
    assert a.offset.abs().max() <= 0.1
    with pytest.raises(ValueError, match="unknown shift 'fog'; allowed: none, rotation"):
        fs.make_shift("fog", 1, 3, 0, 0)


def digits_module(data_root: Path, **kwargs) -> FederatedDataModule:
    dm = FederatedDataModule("digits", str(data_root), num_clients=6, batch_size=10, **kwargs)
    dm.setup("validate")
    return dm


def test_feature_skew_keeps_the_label_split_and_is_bitwise_reproducible(data_root):
    plain = digits_module(data_root)
    skewed = digits_module(data_root, feature_skew=["none", "gaussian_noise", "rotation"])
    again = digits_module(data_root, feature_skew=["none", "gaussian_noise", "rotation"])
    assert all(torch.equal(a, b) for a, b in zip(plain.client_indices, skewed.client_indices))
    assert sorted(skewed.client_domain.tolist()) == [0, 0, 1, 1, 2, 2]
    for k in range(6):
        (x0, y0), (x1, y1), (x2, y2) = (next(m.client_batches(k, 3, 1, seed=5)) for m in (plain, skewed, again))
        assert torch.equal(y0, y1) and torch.equal(x1, x2)
        assert torch.equal(x0, x1) == (skewed.domains[skewed.client_domain[k]] == "none"), k


def test_the_test_set_is_evaluated_under_every_shift(data_root):
    dm = digits_module(data_root, feature_skew=["none", "contrast"], eval_batch_size=100)
    batches = list(EvalBatches(dm))
    n = len(dm.y_test)
    assert sum(len(y) for _, y in batches) == 2 * n and dm._eval_batch_domains[0] == 0
    assert dm._eval_batch_domains[-1] == 1
    clean = torch.cat([x for x, _ in batches[:len(batches) // 2]])
    assert torch.equal(clean, dm.model_input(dm.x_test))


def test_bad_feature_skew_keys_are_one_line(data_root):
    with pytest.raises(ValueError, match=r"^data.feature_skew: unknown shift 'fog'; allowed: none, rotation"):
        FederatedDataModule("digits", str(data_root), feature_skew=["fog"])
    with pytest.raises(ValueError, match=r"^data.feature_skew_severity must be in 1..5, got 6"):
        FederatedDataModule("digits", str(data_root), feature_skew=["contrast"], feature_skew_severity=6)
    with pytest.raises(ValueError, match=r"^data.domain_split dirichlet mixes the domains"):
        FederatedDataModule("digits", str(data_root), feature_skew=["contrast"], domain_split="dirichlet")


def test_feature_skew_trains_resumes_and_logs_each_domain(data_root, tmp_path, capsys):
    curves = fit_resume_report(("--data.dataset", "digits", "--data.root", str(data_root),
                                "--data.feature_skew", "[none, pixelate, shot_noise]"), tmp_path, capsys)
    per_domain = np.stack([curves[f"val/acc/{d}"][1] for d in ("none", "pixelate", "shot_noise")])
    np.testing.assert_allclose(curves["val/acc"][1], per_domain.mean(axis=0), atol=1e-6)
