"""The typed records that replaced the string contracts between the sources, the metrics line and
the stop rules: an iteration's ``StageTimes`` (its ``time/*`` figures made in one place), and the
gold rule fed each evaluation (``GoldWatch``) as it once re-read the metrics file."""

import pytest

from rayppo.run.gold import GoldWatch, plateau, points_of
from rayppo.run.stage_times import StageTimes
from rayppo.trainers.clock import PHASES, Stage, StageClock


def test_each_source_s_times_name_the_figures_it_measures_and_no_other():
    in_process = StageTimes(generate=1.0, reference=0.5, reward=0.25, learn=2.0, sync=0.0, iteration=3.75)
    assert in_process.metrics() == {"time/generate": 1.0, "time/reference": 0.5, "time/reward": 0.25,
                                    "time/learn": 2.0, "time/sync": 0.0, "time/iteration": 3.75}
    synchronous = StageTimes(generate=1.0, reference=0.5, reward=0.25, learn=2.0, sync=0.75, iteration=4.25,
                             score=0.5, sync_verify=0.25)
    assert set(synchronous.metrics()) == set(in_process.metrics()) | {"time/score", "time/sync_verify"}
    assert not synchronous.overlapped
    pipelined = StageTimes(generate=3.0, reference=0.5, reward=0.25, learn=2.0, sync=0.5, iteration=4.0,
                           score=0.5, sync_verify=0.0, wait_for_data=0.25)
    figures = pipelined.metrics()
    assert pipelined.overlapped and figures["time/wait_for_data"] == 0.25
    assert figures["async/generator_idle"] == pytest.approx(0.25) and figures["async/learner_idle"] == 0.5


def test_the_stage_clock_times_stages_in_the_order_they_ran_and_names_the_phase():
    clock = StageClock()
    with clock.stage(Stage.GENERATE):
        assert clock.phase == "generate"
    with clock.stage(Stage.LEARN):
        pass
    assert list(clock.seconds) == [Stage.GENERATE, Stage.LEARN] and clock.phase == "idle"
    assert {Stage.GENERATE, Stage.SCORE, Stage.WAIT, Stage.LEARN, Stage.SYNC, Stage.VERIFY} <= set(PHASES)


def test_the_gold_watch_fed_each_evaluation_says_what_the_metrics_file_would():
    proxy, gold = [0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.35, 0.38]
    records = [{"iteration": 5 * i + 4, "eval/reward/mean": p, "eval/gold/mean": g} for i, (p, g) in
               enumerate(zip(proxy, gold))]
    watch = GoldWatch(2)
    for record in records:
        watch.evaluated(int(record["iteration"]), record["eval/reward/mean"], record["eval/gold/mean"])
    watch.evaluated(20, 0.9, None)  # no gold scorer on this one: not counted
    assert watch.verdict() == plateau(points_of(records), 2) is not None
    resumed = GoldWatch.of_records(2, records[:3])  # a resume reads the evaluations before it once
    assert resumed.verdict() == plateau(points_of(records[:3]), 2) is None
    watch.rewind(15)  # a learner restart redoes iterations 15 on: their evaluations go
    assert [p.iteration for p in watch.points] == [4, 9, 14] and watch.verdict() is None
