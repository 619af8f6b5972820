"""Screening: catches noise, no-ops, sign flips, copies and replays; never rejects honest deltas."""

from __future__ import annotations

import pytest
import torch

from veriloco.hashing import canonical_json, sha256_hex
from veriloco.verify import (
    ACCEPT,
    COSINE_OUTLIER,
    DUPLICATE,
    MALFORMED,
    NEAR_DUPLICATE,
    NO_LOSS_GAIN,
    NORM_OUTLIER,
    WRONG_DATA,
)
from veriloco.verify.aggregate import aggregate, det_norm, flatten
from veriloco.verify.screen import (
    LossGain,
    ScreenConfig,
    loss_gain_verdict,
    measure_loss_gain,
    screen_round,
)

D = 128


def honest_round(
    n: int,
    seed: int,
    noise: float = 1.0,
    jitter: float = 0.25,
    direction: torch.Tensor | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """n honest deltas: a common direction plus per-worker noise, with per-worker scale jitter
    (shards of different difficulty), split into two named tensors like a model's params."""
    g = torch.Generator().manual_seed(seed)
    common = direction if direction is not None else torch.randn(D, generator=g)
    out = {}
    for w in range(n):
        scale = 1 + jitter * (2 * torch.rand((), generator=g).item() - 1)
        v = scale * (common + noise * torch.randn(D, generator=g))
        out[w] = {"layer.weight": v[: D // 2].reshape(8, 8), "layer.bias": v[D // 2 :]}
    return out


def hashes_of(deltas) -> dict[int, str]:
    """Stand-in packet hashes: distinct deltas, distinct hashes."""
    return {w: sha256_hex(flatten(d).numpy().tobytes()) for w, d in deltas.items()}


def reasons(verdicts) -> dict[int, str]:
    for v in verdicts.values():
        canonical_json(v.to_dict())  # evidence is JSON-serialisable (no NaN/inf, no tensors)
    return {w: v.reason for w, v in verdicts.items()}


def test_honest_deltas_zero_false_rejections_over_200_seeds():
    rejected = []
    for seed in range(200):
        n = 3 + seed % 6
        noise = (0.5, 1.0, 2.0)[seed % 3]
        g = torch.Generator().manual_seed(10_000 + seed)
        direction = torch.randn(D, generator=g)
        prev = honest_round(n, 20_000 + seed, noise, direction=direction)
        cur = honest_round(n, seed, noise, direction=direction)  # same direction as last round
        cfg = ScreenConfig(centre="geometric_median") if seed % 4 == 0 else None
        verdicts = screen_round(
            cur,
            packet_hashes=hashes_of(cur),
            previous_packet_hashes=hashes_of(prev),
            previous_deltas=prev,
            config=cfg,
        )
        rejected += [(seed, w, v.reason, v.evidence) for w, v in verdicts.items() if not v.accepted]
    assert not rejected, rejected[:3]


def test_huge_noise_is_a_norm_outlier():
    deltas = honest_round(5, 1)
    deltas[3] = {k: 100 * torch.randn_like(v) for k, v in deltas[3].items()}
    v = screen_round(deltas, packet_hashes=hashes_of(deltas))
    assert reasons(v) == {0: ACCEPT, 1: ACCEPT, 2: ACCEPT, 3: NORM_OUTLIER, 4: ACCEPT}
    assert v[3].evidence["norm_ratio"] > 10
    assert v[3].evidence["consensus_workers"] == [0, 1, 2, 3, 4]


def test_zero_delta_is_rejected_even_alone():
    deltas = honest_round(4, 2)
    deltas[1] = {k: torch.zeros_like(t) for k, t in deltas[1].items()}
    v = screen_round(deltas)
    assert reasons(v) == {0: ACCEPT, 1: NORM_OUTLIER, 2: ACCEPT, 3: ACCEPT}
    assert v[1].evidence["zero"] is True and v[1].evidence["norm"] == 0.0
    alone = screen_round({5: torch.zeros(D)})
    assert alone[5].reason == NORM_OUTLIER


def test_tiny_delta_is_a_norm_outlier():
    deltas = honest_round(5, 3)
    deltas[0] = {k: 0.05 * t for k, t in deltas[0].items()}  # a worker that barely trained
    assert reasons(screen_round(deltas))[0] == NORM_OUTLIER


def test_sign_flip_and_ipm_are_cosine_outliers():
    deltas = honest_round(5, 4)
    deltas[2] = {k: -t for k, t in deltas[2].items()}
    v = screen_round(deltas, packet_hashes=hashes_of(deltas))
    assert reasons(v) == {0: ACCEPT, 1: ACCEPT, 2: COSINE_OUTLIER, 3: ACCEPT, 4: ACCEPT}
    assert v[2].evidence["cosine_to_centre"] < 0
    assert 1 / 3 <= v[2].evidence["norm_ratio"] <= 3  # the norm alone would not catch it
    # Inner Product Manipulation (Xie et al. 2019): send -eps * mean of the honest deltas
    honest = honest_round(5, 5)
    mean = aggregate(honest, "mean")
    honest[4] = {k: -1.0 * t for k, t in mean.items()}
    assert reasons(screen_round(honest))[4] == COSINE_OUTLIER


def test_exact_copy_is_a_duplicate_for_both():
    deltas = honest_round(5, 6)
    deltas[4] = {k: t.clone() for k, t in deltas[1].items()}
    hashes = hashes_of(deltas)
    assert hashes[4] == hashes[1]
    v = screen_round(deltas, packet_hashes=hashes)
    assert reasons(v) == {0: ACCEPT, 1: DUPLICATE, 2: ACCEPT, 3: ACCEPT, 4: DUPLICATE}
    assert v[4].evidence["duplicate_of"] == [1] and v[1].evidence["duplicate_of"] == [4]
    # without packet hashes the vectors themselves still give it away
    assert reasons(screen_round(deltas))[4] == NEAR_DUPLICATE


@pytest.mark.parametrize("kind", ["noise", "rescaled"])
def test_copy_with_small_noise_or_rescaled_is_a_near_duplicate(kind):
    deltas = honest_round(5, 7)
    g = torch.Generator().manual_seed(0)
    if kind == "noise":
        deltas[3] = {
            k: t + 1e-4 * t.abs().mean() * torch.randn(t.shape, generator=g)
            for k, t in deltas[0].items()
        }
    else:
        deltas[3] = {k: 0.7 * t for k, t in deltas[0].items()}
    v = screen_round(deltas, packet_hashes=hashes_of(deltas))
    assert reasons(v) == {0: NEAR_DUPLICATE, 1: ACCEPT, 2: ACCEPT, 3: NEAR_DUPLICATE, 4: ACCEPT}
    hit = v[3].evidence["near_duplicate_of"][0]
    assert hit["worker"] == 0 and hit["cosine"] > 0.999


def test_the_ends_of_a_copy_are_kept_in_for_replays_only_where_nothing_else_is_held_against_them():
    """check.screen_checked's replay_copies: where replays can tell the original, both ends of a
    same-round copy stay in for every member to replay (RoundCheck.copies); an end with another flag
    (a scaled copy is a norm outlier too) is refused but replayed all the same (else that flag would
    spare a copier its conviction: the forty-third session's review); one replays cannot judge is
    refused as before, and a copy of the previous round, which has one sender, is no copy to
    replay."""
    from veriloco.verify.check import RoundCheck, screen_checked
    from veriloco.verify.screen import copied_only

    prev = honest_round(10, 31)
    deltas = honest_round(10, 30)  # 6, 7 and 9 make the centre
    deltas[4] = {k: t.clone() for k, t in deltas[1].items()}  # 4 copies 1 exactly
    deltas[3] = {k: t + 1e-4 * t.abs().mean() for k, t in deltas[0].items()}  # 3 nearly copies 0 ...
    deltas[2] = {k: t.clone() for k, t in prev[2].items()}  # ... 2 resends its previous delta
    deltas[8] = {k: 4 * t for k, t in deltas[5].items()}  # ... and 8 sends 5's, scaled up
    hashes = hashes_of(deltas)
    prev_hashes = hashes_of(prev)

    def screened(replay_copies):
        check = RoundCheck({j: ACCEPT for j in deltas}, {}, {j: None for j in deltas}, hashes, {}, dict(deltas))
        return screen_checked(check, base_hash="b", previous=(prev_hashes, prev), replay_copies=replay_copies)

    kept = screened(lambda signed, delta: True)
    assert kept.copies == {0: [3], 1: [4], 3: [0], 4: [1], 5: [8], 8: [5]}
    assert sorted(kept.accepted) == [0, 1, 3, 4, 5, 6, 7, 9]
    assert kept.verdicts[8] == NEAR_DUPLICATE and NORM_OUTLIER in kept.evidence[8]["flags"]  # refused, and replayed
    assert kept.verdicts[2] == DUPLICATE and 2 not in kept.copies
    for refused in (screened(None), screened(lambda signed, delta: delta is not deltas[4])):
        assert refused.verdicts[4] == DUPLICATE and 4 not in refused.copies
    assert screened(None).verdicts == {0: NEAR_DUPLICATE, 1: DUPLICATE, 2: DUPLICATE, 3: NEAR_DUPLICATE, 4: DUPLICATE,
                                       5: NEAR_DUPLICATE, 6: ACCEPT, 7: ACCEPT, 8: NEAR_DUPLICATE, 9: ACCEPT}
    # the screen measures an end of a copy against the centre as it does a candidate (a copied outlier is one)
    v = screen_round(deltas, packet_hashes=hashes, previous_packet_hashes=prev_hashes, previous_deltas=prev)
    assert v[4].evidence["norm_ratio"] is not None and copied_only(v[4].evidence) == [1]
    assert copied_only(v[2].evidence) is None and copied_only(v[0].evidence) == [3]
    far = dict(deltas) | {4: {k: -5 * t for k, t in deltas[1].items()}, 1: {k: -5 * t for k, t in deltas[1].items()}}
    v = screen_round(far, packet_hashes=hashes)
    assert v[4].evidence["flags"][0] == DUPLICATE and NORM_OUTLIER in v[4].evidence["flags"]
    assert copied_only(v[4].evidence) is None


def test_replay_of_previous_round():
    prev = honest_round(4, 8)
    cur = honest_round(4, 9)
    cur[2] = {k: t.clone() for k, t in prev[3].items()}  # worker 2 resends worker 3's old delta
    v = screen_round(
        cur,
        packet_hashes=hashes_of(cur),
        previous_packet_hashes=hashes_of(prev),
        previous_deltas=prev,
    )
    assert reasons(v) == {0: ACCEPT, 1: ACCEPT, 2: DUPLICATE, 3: ACCEPT}
    assert v[2].evidence["duplicate_of_previous"] == [3]
    # re-encoded (different packet bytes) with a little noise: caught by the vectors
    cur[2] = {k: t * 1.0001 for k, t in prev[3].items()}
    v = screen_round(cur, packet_hashes=hashes_of(cur), previous_deltas=prev)
    assert reasons(v)[2] == NEAR_DUPLICATE
    assert v[2].evidence["near_duplicate_of_previous"][0]["worker"] == 3


def test_stale_resubmission_of_the_previous_mean_is_a_near_duplicate():
    prev = honest_round(4, 18)
    cur = honest_round(4, 19)
    # worker 1 skips training and resends the average of last round's accepted updates, in float32
    cur[1] = {k: sum(prev[j][k] for j in range(4)) / 4 for k in prev[0]}
    v = screen_round(cur, packet_hashes=hashes_of(cur), previous_packet_hashes=hashes_of(prev), previous_deltas=prev)
    assert reasons(v) == {0: ACCEPT, 1: NEAR_DUPLICATE, 2: ACCEPT, 3: ACCEPT}
    hit = v[1].evidence["near_duplicate_of_previous_mean"]
    assert hit["cosine"] > 0.999999 and hit["rel_dist"] < 1e-6


def test_non_finite_delta_is_malformed():
    deltas = honest_round(4, 10)
    deltas[0]["layer.bias"][3] = float("nan")
    v = screen_round(deltas)
    assert reasons(v) == {0: MALFORMED, 1: ACCEPT, 2: ACCEPT, 3: ACCEPT}
    assert v[0].evidence["norm"] is None


def test_one_and_two_workers_no_outvoting():
    one = screen_round(honest_round(1, 11))
    assert (
        one[0].accepted and "skipped" in one[0].evidence and one[0].evidence["norm_ratio"] is None
    )
    # two workers: neither can outvote the other, so a huge one is not rejected by the centre...
    two = honest_round(2, 12)
    two[1] = {k: 100 * torch.randn_like(t) for k, t in two[1].items()}
    assert reasons(screen_round(two)) == {0: ACCEPT, 1: ACCEPT}
    # ...but the loss-gain check, which compares no workers, still catches the noise
    gains = {0: LossGain(3.0, 2.5, 3.0, 2.8), 1: LossGain(3.0, 9.0, 3.0, 9.5)}
    assert reasons(screen_round(two, loss_gains=gains)) == {0: ACCEPT, 1: NO_LOSS_GAIN}


def test_three_workers_outvote_one():
    deltas = honest_round(3, 13)
    deltas[1] = {k: -t for k, t in deltas[1].items()}
    assert reasons(screen_round(deltas)) == {0: ACCEPT, 1: COSINE_OUTLIER, 2: ACCEPT}
    deltas = honest_round(3, 14)
    deltas[2] = {k: 50 * t for k, t in deltas[2].items()}
    assert reasons(screen_round(deltas)) == {0: ACCEPT, 1: ACCEPT, 2: NORM_OUTLIER}


def test_copies_do_not_count_towards_the_centre():
    # 2 honest + 2 copies of a sign-flipped delta: the copies are removed first, leaving too
    # few workers for a centre, rather than letting the copies outvote the honest pair
    deltas = honest_round(2, 15)
    bad = {k: -t for k, t in deltas[0].items()}
    deltas[2] = bad
    deltas[3] = {k: t.clone() for k, t in bad.items()}
    v = screen_round(deltas, packet_hashes=hashes_of(deltas))
    assert reasons(v) == {0: ACCEPT, 1: ACCEPT, 2: DUPLICATE, 3: DUPLICATE}
    assert v[0].evidence["consensus_workers"] == [0, 1]


def test_loss_gain_verdict_thresholds():
    assert loss_gain_verdict(LossGain(3.0, 2.5, 3.0, 2.9)) is None  # own 0.5 > random 0.1
    assert loss_gain_verdict(LossGain(3.0, 3.0, 3.0, 3.0)) == NO_LOSS_GAIN  # a no-op
    assert loss_gain_verdict(LossGain(3.0, 3.2, 3.0, 2.0)) == NO_LOSS_GAIN  # own loss went up
    assert loss_gain_verdict(LossGain(3.0, 2.5, 3.0, 2.5)) == WRONG_DATA  # no own advantage
    assert loss_gain_verdict(LossGain(3.0, 2.5, 3.0, 2.4)) == WRONG_DATA
    assert loss_gain_verdict(LossGain(3.0, float("nan"), 3.0, 2.4)) == NO_LOSS_GAIN
    assert loss_gain_verdict(LossGain(3.0, 2.5, 3.0, 2.9), min_own_advantage=0.5) == WRONG_DATA
    assert loss_gain_verdict(LossGain(3.0, 2.5, 3.0, 2.9), min_own_gain=0.6) == NO_LOSS_GAIN


def test_measure_loss_gain_gauntlet_style():
    """Toy model: params theta, loss = mean ||theta - b||^2 over batches b. G_r = 0. Data has a
    common part m; each worker's batches add its own part (u: own, v: random draws)."""
    m, u, v, other = (torch.eye(4)[i] * s for i, s in enumerate((2.0, 1.0, 1.0, 1.5)))
    g_r = {"theta": torch.zeros(4)}
    own = [m + u, m + u]
    rand = [m + v, m + v]

    def loss_of(delta, batches):
        theta = g_r["theta"] - delta["theta"]
        return float(sum(((theta - b) ** 2).sum() for b in batches) / len(batches))

    honest = {"theta": -0.5 * (m + u)}  # trained on its own batches (theta moved halfway there)
    general = {"theta": -0.5 * m}  # trained on data other than its own: helps everywhere alike
    elsewhere = {"theta": -0.5 * (m + other)}  # trained on someone else's shard
    noise = {"theta": torch.tensor([3.0, -3.0, 3.0, -3.0])}
    gains = {
        w: measure_loss_gain(d, own, rand, loss_of)
        for w, d in enumerate([honest, general, elsewhere, noise])
    }
    assert gains[0].own_gain == pytest.approx(0.75 * 5) and gains[0].advantage == pytest.approx(1.0)
    assert gains[1].advantage == pytest.approx(0.0)
    verdicts = {w: loss_gain_verdict(g) for w, g in gains.items()}
    assert verdicts == {0: None, 1: WRONG_DATA, 2: WRONG_DATA, 3: NO_LOSS_GAIN}


def test_alie_passes_the_screen_but_centered_clip_bounds_it():
    """A Little Is Enough (Baruch et al. 2019): mean - z * std per coordinate hides in the
    honest spread, so the screen accepts it (documented); the aggregator bounds its effect."""
    honest = honest_round(6, 16)
    flat = torch.stack([flatten(d) for d in honest.values()])
    alie = (flat.mean(0) - 1.0 * flat.std(0)).float()
    deltas = {w: flatten(d).float() for w, d in honest.items()} | {6: alie}
    assert screen_round(deltas)[6].accepted
    start = flatten(aggregate(honest, "median")).float()
    tau = 1.0
    with_alie = aggregate(deltas, "centered_clip", tau=tau, iterations=1, start=start)
    without = aggregate({**deltas, 6: start}, "centered_clip", tau=tau, iterations=1, start=start)
    assert det_norm(flatten(with_alie - without)) <= tau / 7 + 1e-5


def test_verdicts_are_deterministic():
    deltas = honest_round(6, 17)
    deltas[5] = {k: -t for k, t in deltas[5].items()}
    a = [canonical_json(v.to_dict()) for v in screen_round(deltas).values()]
    b = [canonical_json(v.to_dict()) for v in screen_round(dict(reversed(deltas.items()))).values()]
    assert a == b


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"centre": "mean"}, "centre must be one of"),
        ({"min_workers": 2}, "min_workers must be an int >= 3"),
        ({"norm_hi": 0.5}, "norm_hi=0.5"),
        ({"norm_lo": 0.0}, "norm_lo=0.0"),
        ({"min_cosine": 1.0}, r"min_cosine must be in \[-1, 1\), got 1.0"),
        ({"near_dup_cosine": 0.0}, "near_dup_cosine"),
        ({"near_dup_rel_dist": 1.0}, "near_dup_rel_dist"),
        ({"min_own_gain": float("nan")}, "min_own_gain must be finite"),
    ],
)
def test_config_rejects_bad_thresholds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScreenConfig(**kwargs)


def test_mismatched_sizes_are_an_error():
    with pytest.raises(ValueError, match="different sizes"):
        screen_round({0: torch.zeros(3), 1: torch.zeros(4)})
