"""Tests for fedrcl.losses.relaxed_contrastive."""

import math

import pytest
import torch

from fedrcl.losses.relaxed_contrastive import (
    relaxed_contrastive_loss,
    relaxed_contrastive_terms,
)


# ---------------------------------------------------------------------------
# Slow float64 reference: explicit loops over anchors, straight from the maths.
# ---------------------------------------------------------------------------
def reference_terms(features, labels, temperature, threshold, pos_topk, neg_topk):
    f = features.double()
    f = f / f.norm(dim=1, keepdim=True)
    s = (f @ f.T).tolist()
    y = labels.tolist()
    t = temperature
    n = len(y)
    scls, pens = [], []
    for i in range(n):
        partners = [j for j in range(n) if j != i and y[j] == y[i]]
        if pos_topk is None:
            others = [k for k in range(n) if k != i]
            denom = sum(math.exp(s[i][k] / t) for k in others)
            losses = [-math.log(math.exp(s[i][j] / t) / denom) for j in partners]
            scls.append(sum(losses) / len(losses) if losses else 0.0)
            kept = [j for j in partners if s[i][j] >= threshold]
        else:
            cands = sorted([j for j in range(n) if y[j] == y[i]], key=lambda j: s[i][j])
            positives = cands[:pos_topk]
            negs = sorted([j for j in range(n) if y[j] != y[i]], key=lambda j: -s[i][j])
            negatives = negs[:neg_topk]
            losses = []
            for p in positives:
                ep = math.exp(s[i][p] / t)
                en = sum(math.exp(s[i][k] / t) for k in negatives)
                losses.append(-math.log(ep / (ep + en)))
            scls.append(sum(losses) / len(losses))
            hardest = sorted(partners, key=lambda j: s[i][j])[:pos_topk]
            kept = [j for j in hardest if s[i][j] >= threshold]
        pens.append(math.log(1.0 + sum(math.exp((s[i][j] - s[i][i]) / t) for j in kept)))
    return sum(scls) / n, sum(pens) / n


def _random_case(seed, batch, dim, num_classes, clustered):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    feats = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    if clustered:  # same-class pairs get high similarity, so the penalty is active
        centres = 3.0 * torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
        feats = centres[labels] + 0.5 * feats
    return feats, labels


FORMS = [(None, None), (1, 1), (1, 2), (1, 5), (3, 1), (3, 2), (3, 5)]
CASES = [
    # (seed, B, D, num_classes, clustered)
    (0, 2, 3, 2, False),
    (1, 2, 8, 1, True),  # single class: no negatives
    (2, 7, 3, 3, True),
    (3, 7, 8, 7, False),  # many classes: mostly singletons
    (4, 16, 3, 4, True),
    (5, 16, 8, 1, False),  # single class
    (6, 16, 8, 12, True),  # some singleton classes
    (7, 33, 3, 2, True),
    (8, 33, 8, 20, False),
    (9, 33, 8, 5, True),
]


@pytest.mark.parametrize("pos_topk,neg_topk", FORMS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threshold", [0.7, -1.0])
def test_matches_loop_reference(case, pos_topk, neg_topk, threshold):
    feats, labels = _random_case(*case)
    kw = dict(temperature=0.1, threshold=threshold, pos_topk=pos_topk, neg_topk=neg_topk)
    ref_scl, ref_pen = reference_terms(feats, labels, **kw)

    scl, pen = relaxed_contrastive_terms(feats, labels, **kw)
    assert scl.dtype == torch.float64
    assert scl.item() == pytest.approx(ref_scl, rel=1e-9, abs=1e-9)
    assert pen.item() == pytest.approx(ref_pen, rel=1e-9, abs=1e-9)

    scl32, pen32 = relaxed_contrastive_terms(feats.float(), labels, **kw)
    assert scl32.dtype == torch.float32
    assert scl32.item() == pytest.approx(ref_scl, rel=1e-4, abs=1e-5)
    assert pen32.item() == pytest.approx(ref_pen, rel=1e-4, abs=1e-5)


def test_reference_cases_exercise_penalty_and_empty_negatives():
    """Guards the random cases above against being vacuous."""
    pens, scls = [], []
    for case in CASES:
        feats, labels = _random_case(*case)
        scl, pen = reference_terms(feats, labels, 0.1, 0.7, 1, 2)
        pens.append(pen)
        scls.append(scl)
    assert sum(p > 0 for p in pens) >= 3
    assert scls[1] == 0.0 and scls[5] == 0.0  # single-class batches


# ---------------------------------------------------------------------------
# Hand-computed cases, temperature t = 0.5, threshold 0.7.
# ---------------------------------------------------------------------------
def _unit(*xy):
    return torch.tensor(xy, dtype=torch.float64)


# a=(1,0), b=(.8,.6), c=(0,1), d=(-1,0); labels 0,0,1,1.
# Cosines: ab=.8 ac=0 ad=-1 bc=.6 bd=-.8 cd=0, so s/t: ab=1.6 ac=0 ad=-2 bc=1.2 bd=-1.6 cd=0.
FOUR = (_unit([1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]), torch.tensor([0, 0, 1, 1]))


def test_hand_four_points_hard_mining():
    # SCL_i = log(1 + sum_n e^{(s_in - s_ip)/t}) with p the only partner, negs both others:
    # a: log(1 + e^{-1.6} + e^{-3.6}); b: log(1 + e^{-0.4} + e^{-3.2});
    # c: log(1 + e^{0} + e^{1.2});     d: log(1 + e^{-2} + e^{-1.6});  mean = 0.6764007552163327
    # Penalty: a,b: partner at .8 >= .7 -> log(1 + e^{(.8-1)/.5}) = log(1 + e^{-0.4});
    # c,d: partner at 0 < .7 -> 0.  mean = log(1 + e^{-0.4}) / 2 = 0.2565076261999763
    scl, pen = relaxed_contrastive_terms(*FOUR, temperature=0.5, threshold=0.7)
    assert scl.item() == pytest.approx(0.6764007552163327, abs=1e-12)
    assert pen.item() == pytest.approx(0.2565076261999763, abs=1e-12)
    # With two classes of two and neg_topk=2 nothing is mined away: all-pairs agrees.
    scl_all, pen_all = relaxed_contrastive_terms(
        *FOUR, temperature=0.5, threshold=0.7, pos_topk=None, neg_topk=None
    )
    assert scl_all.item() == pytest.approx(0.6764007552163327, abs=1e-12)
    assert pen_all.item() == pytest.approx(0.2565076261999763, abs=1e-12)


def test_hand_four_points_one_negative():
    # neg_topk=1 keeps only the most similar negative:
    # a: c (0)    -> log(1 + e^{-1.6});  b: c (.6)  -> log(1 + e^{-0.4});
    # c: b (.6)   -> log(1 + e^{1.2});   d: b (-.8) -> log(1 + e^{-1.6});  mean = 0.5860248003786654
    scl, _ = relaxed_contrastive_terms(*FOUR, temperature=0.5, neg_topk=1)
    assert scl.item() == pytest.approx(0.5860248003786654, abs=1e-12)


def test_penalty_zero_below_threshold():
    # Highest partner similarity is .8 < .9, so every penalty term is exactly 0.
    for pk, nk in [(1, 2), (None, None)]:
        _, pen = relaxed_contrastive_terms(
            *FOUR, temperature=0.5, threshold=0.9, pos_topk=pk, neg_topk=nk
        )
        assert pen.item() == 0.0


# a=(1,0), b=(.8,.6), e=(.6,.8) in class 0; d=(-1,0) alone in class 1.
# Cosines: ab=.8 ae=.6 be=.96 ad=-1 bd=-.8 ed=-.6.
THREE_ONE = (
    _unit([1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [-1.0, 0.0]),
    torch.tensor([0, 0, 0, 1]),
)


def test_hand_hardest_positive_and_self_positive():
    # Positive = least similar of the class incl. self; negatives: top-2 most similar.
    # a: pos e (.6), neg d (-1):  log(1 + e^{(-1-.6)/.5})  = log(1 + e^{-3.2})
    # b: pos a (.8), neg d (-.8): log(1 + e^{(-.8-.8)/.5}) = log(1 + e^{-3.2})
    # e: pos a (.6), neg d (-.6): log(1 + e^{(-.6-.6)/.5}) = log(1 + e^{-2.4})
    # d: no partner -> pos d itself (1); negs e (-.6), b (-.8):
    #    log(1 + e^{(-.6-1)/.5} + e^{(-.8-1)/.5}) = log(1 + e^{-3.2} + e^{-3.6})
    # mean = 0.05815275280879588
    # Penalty on the least similar partner only: a: e (.6 < .7) -> 0;
    # b: a (.8) -> log(1 + e^{-0.4}); e: a (.6) -> 0; d: none -> 0.
    # mean = log(1 + e^{-0.4}) / 4 = 0.12825381309998815
    scl, pen = relaxed_contrastive_terms(*THREE_ONE, temperature=0.5, threshold=0.7)
    assert scl.item() == pytest.approx(0.05815275280879588, abs=1e-12)
    assert pen.item() == pytest.approx(0.12825381309998815, abs=1e-12)


def test_hand_all_pairs():
    # s/t: ab=1.6 ae=1.2 ad=-2 be=1.92 bd=-1.6 ed=-1.2.
    # a: L=log(e^1.6+e^1.2+e^-2), SCL=((L-1.6)+(L-1.2))/2; b: L=log(e^1.6+e^1.92+e^-1.6),
    # SCL=((L-1.6)+(L-1.92))/2; e: L=log(e^1.2+e^1.92+e^-1.2), SCL=((L-1.2)+(L-1.92))/2;
    # d: no partner -> 0.  mean = 0.5594996177156002
    # Penalty (partners >= .7): a: b -> log(1+e^{-0.4}); b: a, e -> log(1+e^{-0.4}+e^{-0.08});
    # e: b -> log(1+e^{-0.08}); d: 0.  mean = 0.5299865021146773
    scl, pen = relaxed_contrastive_terms(
        *THREE_ONE, temperature=0.5, threshold=0.7, pos_topk=None, neg_topk=None
    )
    assert scl.item() == pytest.approx(0.5594996177156002, abs=1e-12)
    assert pen.item() == pytest.approx(0.5299865021146773, abs=1e-12)


def test_hand_singletons_use_self_as_positive():
    # a=(1,0) class 0, b=(.6,.8) class 1; cos = .6.  Each is its own positive (s=1):
    # -log(e^{1/.5} / (e^{1/.5} + e^{.6/.5})) = log(1 + e^{-0.8}) = 0.3711006659477777.
    feats, labels = _unit([1.0, 0.0], [0.6, 0.8]), torch.tensor([0, 1])
    scl, pen = relaxed_contrastive_terms(feats, labels, temperature=0.5)
    assert scl.item() == pytest.approx(0.3711006659477777, abs=1e-12)
    assert pen.item() == 0.0
    # The paper's form has no positives here at all.
    scl_all, pen_all = relaxed_contrastive_terms(
        feats, labels, temperature=0.5, pos_topk=None, neg_topk=None
    )
    assert scl_all.item() == 0.0 and pen_all.item() == 0.0


def test_hand_single_class_batch():
    # No negatives -> SCL = -log(1) = 0; penalty: partner at .8 -> log(1 + e^{-0.4}) = 0.5130152523999526.
    feats, labels = _unit([1.0, 0.0], [0.8, 0.6]), torch.tensor([3, 3])
    scl, pen = relaxed_contrastive_terms(feats, labels, temperature=0.5, threshold=0.7)
    assert scl.item() == 0.0
    assert pen.item() == pytest.approx(0.5130152523999526, abs=1e-12)


def test_features_are_normalised():
    feats, labels = FOUR
    scale = torch.tensor([[2.0], [0.1], [7.0], [3.0]], dtype=torch.float64)
    a = relaxed_contrastive_terms(feats, labels, temperature=0.5)
    b = relaxed_contrastive_terms(feats * scale, labels, temperature=0.5)
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------
# Loss composition.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("pk,nk", [(1, 2), (None, None)])
def test_loss_combines_terms(pk, nk):
    feats, labels = _random_case(11, 16, 8, 3, True)
    kw = dict(temperature=0.2, threshold=0.5, pos_topk=pk, neg_topk=nk)
    scl, pen = relaxed_contrastive_terms(feats, labels, **kw)
    assert pen.item() > 0
    assert relaxed_contrastive_loss(feats, labels, beta=0.0, **kw).item() == scl.item()
    for beta in (0.5, 1.0, 3.0):
        loss = relaxed_contrastive_loss(feats, labels, beta=beta, **kw)
        assert loss.dim() == 0
        assert loss.item() == pytest.approx((scl + beta * pen).item(), rel=1e-12)


# ---------------------------------------------------------------------------
# Gradients, autocast, vmap.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("pk,nk", [(1, 2), (3, 5), (None, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_finite_and_nonzero(pk, nk, dtype):
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(12, 6, generator=g, dtype=dtype)
    feats[5] = feats[2]  # duplicate rows, same class
    feats[7] = feats[2]  # duplicate row, different class
    feats[9] = feats[8] * 1e-3  # same direction
    labels = torch.tensor([0, 0, 1, 2, 3, 1, 4, 5, 6, 6, 7, 7])  # several singletons
    feats.requires_grad_(True)
    loss = relaxed_contrastive_loss(
        feats, labels, temperature=0.05, threshold=-1.0, pos_topk=pk, neg_topk=nk
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(feats.grad).all()
    assert feats.grad.abs().sum() > 0


@pytest.mark.parametrize("pk,nk", [(1, 2), (None, None)])
def test_gradients_finite_with_masked_extremes(pk, nk):
    # Single-class batch (every negative masked) and B = 1 (every off-diagonal masked).
    for feats, labels in [
        (torch.randn(5, 4), torch.zeros(5, dtype=torch.long)),
        (torch.randn(1, 4), torch.zeros(1, dtype=torch.long)),
    ]:
        feats.requires_grad_(True)
        relaxed_contrastive_loss(feats, labels, threshold=-1.0, pos_topk=pk, neg_topk=nk).backward()
        assert torch.isfinite(feats.grad).all()


@pytest.mark.parametrize("pk,nk", [(1, 2), (None, None)])
def test_finite_under_bf16_autocast(pk, nk):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 16, generator=g)
    w = torch.randn(16, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 4, (32,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = x @ w
        assert feats.dtype == torch.bfloat16
        loss = relaxed_contrastive_loss(
            feats, labels, temperature=0.05, pos_topk=pk, neg_topk=nk
        )
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(w.grad).all()
    # The similarity matrix is computed in float32, not bf16: same as outside autocast.
    expected = relaxed_contrastive_loss(
        feats.detach().float(), labels, temperature=0.05, pos_topk=pk, neg_topk=nk
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("pk,nk", [(1, 2), (3, 1), (None, None)])
def test_vmap_over_clients_matches_loop(pk, nk):
    g = torch.Generator().manual_seed(9)
    clients, batch, dim = 4, 10, 5
    feats = torch.randn(clients, batch, dim, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (clients, batch), generator=g)
    labels[1] = 2  # one client with a single class
    kw = dict(temperature=0.1, threshold=0.0, pos_topk=pk, neg_topk=nk)

    scl_v, pen_v = torch.func.vmap(lambda f, y: relaxed_contrastive_terms(f, y, **kw))(
        feats, labels
    )
    loss_v = torch.func.vmap(lambda f, y: relaxed_contrastive_loss(f, y, **kw))(feats, labels)
    assert scl_v.shape == pen_v.shape == loss_v.shape == (clients,)
    for c in range(clients):
        scl, pen = relaxed_contrastive_terms(feats[c], labels[c], **kw)
        assert scl_v[c].item() == pytest.approx(scl.item(), rel=1e-12, abs=1e-12)
        assert pen_v[c].item() == pytest.approx(pen.item(), rel=1e-12, abs=1e-12)
        assert loss_v[c].item() == pytest.approx((scl + pen).item(), rel=1e-12)

    grads_v = torch.func.vmap(
        torch.func.grad(lambda f, y: relaxed_contrastive_loss(f, y, **kw))
    )(feats, labels)
    for c in range(clients):
        f = feats[c].clone().requires_grad_(True)
        relaxed_contrastive_loss(f, labels[c], **kw).backward()
        torch.testing.assert_close(grads_v[c], f.grad)


# ---------------------------------------------------------------------------
# Argument validation.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "feats,labels,kw,match",
    [
        (torch.randn(4, 3), torch.zeros(4), dict(pos_topk=None), "pos_topk.*neg_topk"),
        (torch.randn(4, 3), torch.zeros(4), dict(neg_topk=None), "pos_topk.*neg_topk"),
        (torch.randn(4, 3), torch.zeros(4), dict(temperature=0.0), "temperature"),
        (torch.randn(4, 3), torch.zeros(4), dict(temperature=-0.1), "temperature"),
        (torch.randn(4, 3), torch.zeros(4), dict(pos_topk=0), "pos_topk"),
        (torch.randn(4, 3), torch.zeros(4), dict(neg_topk=0), "neg_topk"),
        (torch.randn(4), torch.zeros(4), {}, "2-D"),
        (torch.randn(2, 4, 3), torch.zeros(2), {}, "2-D"),
        (torch.randn(4, 3), torch.zeros(5), {}, "labels"),
    ],
)
def test_bad_arguments(feats, labels, kw, match):
    with pytest.raises(ValueError, match=match):
        relaxed_contrastive_terms(feats, labels.long(), **kw)
    with pytest.raises(ValueError, match=match):
        relaxed_contrastive_loss(feats, labels.long(), **kw)
