"""``python -m mqds.bench.front``: each front end answers both loads and reports its figures."""

from __future__ import annotations

import json

import pytest

from mqds.bench import front as bench_front


@pytest.mark.slow
def test_every_front_end_answers_both_loads_and_reports_its_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_front.main(["--count", "40", "--callers", "4", "--duration", "0.3", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report) == sorted(bench_front.KINDS)
    for kind, (result,) in report.items():
        one, many = result["one_caller"], result["many_callers"]
        assert 0 < one["p50_us"] <= one["p99_us"] < 10_000_000, (kind, one)
        assert one["server_cpu_ms_per_1000"] >= 0, (kind, one)
        assert many["calls_per_s"] > 0 and many["p50_ms"] > 0, (kind, many)


def test_bad_options_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_front.main(["--callers", "0"])
    assert exited.value.code == 2
    assert "--callers" in capsys.readouterr().err
