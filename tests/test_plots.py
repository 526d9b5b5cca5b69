"""plot.png: the reward panel's bands and held-out series, the proxy-and-gold panel (a KL that
cannot be negative on its x axis, each line's points in order) and the KL panel (the budget as a
line only where it leaves the curve readable). The figures' data are checked, not their pixels."""

from __future__ import annotations

import pytest

from rayppo.run.metrics import _kl_panel, _reward_panel, budget_on_scale, gold_curves, plot_metrics


def _records(with_spread: bool, with_eval: bool) -> list[dict[str, float]]:
    records = []
    for it in range(6):
        r = {"iteration": it, "reward/mean": 0.1 * it, "kl/ref_mean": 0.2 * it}
        if with_spread:
            r |= {"reward/std": 0.05, "reward/min": 0.0, "reward/max": 0.1 * it + 0.2}
        if with_eval and it % 2 == 1:
            r |= {"eval/reward/mean": 0.1 * it + 0.05, "eval/greedy/reward/mean": 0.1 * it - 0.05}
        records.append(r)
    return records


@pytest.mark.parametrize("with_spread, with_eval", [(False, False), (True, True)])
def test_plot_metrics_writes_a_png(tmp_path, with_spread, with_eval):
    import matplotlib.image

    png = tmp_path / "plot.png"
    plot_metrics(_records(with_spread, with_eval), png, kl_budget=1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (360, 1000)


def test_reward_panel_draws_bands_and_eval_series():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    records = _records(with_spread=True, with_eval=True)
    _reward_panel(ax, records, [r["iteration"] for r in records])
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["held-out"].get_xdata()) == [1, 3, 5]  # records without eval keys skipped
    assert list(lines["held-out (greedy)"].get_ydata()) == pytest.approx([0.05, 0.25, 0.45])
    assert list(lines["batch mean"].get_xdata()) == list(range(6))
    assert {c.get_label() for c in ax.collections} == {"batch min..max", "mean ± std"}
    plt.close(fig)
    fig, ax = plt.subplots()
    _reward_panel(ax, _records(False, False), list(range(6)))
    assert [line.get_label() for line in ax.get_lines()] == ["batch mean"] and not ax.collections
    plt.close(fig)


def _gold_records(k3: bool) -> list[dict[str, float]]:
    """Five iterations of a run with a gold scorer while the KL is small: the k1 mean dips below 0
    (iteration 1) and the KL falls back for an iteration (3); held out at iterations 1 and 3."""
    k1, k3s = [0.0, -0.02, 0.05, 0.03, 0.08], [0.0, 0.01, 0.04, 0.02, 0.07]
    records = []
    for it in range(5):
        r = {"iteration": it, "reward/mean": 0.5 + 0.1 * it, "reward/gold_mean": 0.4 + 0.05 * it, "kl/ref_mean": k1[it]}
        r |= {"kl/ref_k3_mean": k3s[it]} if k3 else {}
        r |= {"eval/reward/mean": 0.3 + it, "eval/gold/mean": 0.2 + it} if it % 2 else {}
        records.append(r)
    return records


def test_the_proxy_and_gold_panel_draws_a_non_negative_kl_with_its_points_in_order():
    """Joined in iteration order, against a k1 mean that goes below 0, the lines crossed back over
    themselves: x is the k3 mean (>= 0), each line's points sorted along it."""
    xlabel, curves = gold_curves(_gold_records(k3=True))
    assert xlabel.startswith("KL") and set(curves) == {"proxy (reward/mean)", "gold (reward/gold_mean)",
                                                       "held-out proxy", "held-out gold"}
    proxy = curves["proxy (reward/mean)"]
    assert proxy.x == [0.0, 0.01, 0.02, 0.04, 0.07]  # iterations 0, 1, 3, 2, 4
    assert proxy.y == pytest.approx([0.5, 0.6, 0.8, 0.7, 0.9])
    assert curves["gold (reward/gold_mean)"].y == pytest.approx([0.4, 0.45, 0.55, 0.5, 0.6])
    assert curves["held-out gold"].x == [0.01, 0.02] and curves["held-out gold"].y == pytest.approx([1.2, 3.2])
    # A run from before kl/ref_k3_mean was logged: k1 clipped at 0 (a KL is never negative), then sorted.
    _, old = gold_curves(_gold_records(k3=False))
    assert old["proxy (reward/mean)"].x == [0.0, 0.0, 0.03, 0.05, 0.08]
    assert old["proxy (reward/mean)"].y == pytest.approx([0.5, 0.6, 0.8, 0.7, 0.9])
    # Without a reference: against the iteration, in its order.
    _, plain = gold_curves([{k: v for k, v in r.items() if not k.startswith("kl/")} for r in _gold_records(True)])
    assert plain["proxy (reward/mean)"].x == [0, 1, 2, 3, 4]


def test_the_kl_panel_says_the_budget_when_a_line_would_set_its_axis():
    """The 20-nat budget over data at 0.08 is a note, and the axis is the data's; a budget the KL
    reaches a quarter of is a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert not budget_on_scale([0.05, 0.08], 20.0) and budget_on_scale([0.0, 5.0], 20.0)
    fig, ax = plt.subplots()
    _kl_panel(ax, _gold_records(k3=True), kl_budget=20.0)
    assert [t.get_text() for t in ax.texts] == ["stop.kl_budget = 20 nats, off this scale"]
    assert ax.get_ylim()[1] < 0.2  # the data's scale (they reach 0.08), not the budget's
    assert [line.get_label() for line in ax.get_lines()] == ["k1 (the stop rule's)", "k3 (>= 0)"]
    plt.close(fig)
    fig, ax = plt.subplots()
    _kl_panel(ax, _gold_records(k3=True), kl_budget=0.2)
    assert not ax.texts and ax.get_lines()[-1].get_label() == "stop.kl_budget"
    plt.close(fig)
