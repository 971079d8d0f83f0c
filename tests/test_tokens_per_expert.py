"""python -m ktfp8.bench.tokens_per_expert: every (thread count, m, backend) gets a row whose GFLOP/s
and fractions are its layer's FLOPs and bytes over its time and the limits, one backend per m is
marked fastest, the calls really route m tokens to every expert, and bad arguments are refused with
their reason."""
import re

import numpy as np
import pytest

from ktfp8 import backends, roofline
from ktfp8.bench import layers as L
from ktfp8.bench.sides import Ktfp8Side
from ktfp8.bench import tokens_per_expert as tpe

ROW = re.compile(r"^\s*(\d+)\s+(\d+) ([ *])(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\w+)\s+(\d+)%\s+(\d+)%$")
TINY = ["--experts", "4", "--hidden", "64", "--intermediate", "32", "--threads", "1", "--rounds", "1"]


def test_rows_hold_each_backends_flops_over_its_time_against_the_limits_given():
    layer = L.Layer("tiny", 4, 4, 64, 32)
    names = backends.available_backends()  # the scalar reference included: two sides at least
    limit = dict(threads=1, read_gbs=10.0, fma_gflops=50.0, dpbf16_gflops=None, amx_gflops=None, fma512_gflops=None)
    experts = L.random_experts(layer, "fp8_per_channel")
    weight_bytes = 4 * 3 * 64 * 32  # FP8: one byte per weight
    rows = []
    for name in names:
        seconds_by_m = tpe.time_calls([Ktfp8Side(layer, experts, name, 1)], 4, [1, 9], 1, 64)
        rows += tpe.rows_for(layer, weight_bytes, name, 1, seconds_by_m, limit)
    assert sorted((r["m"], r["backend"]) for r in rows) == sorted((m, b) for m in (1, 9) for b in names)
    for r in rows:
        flops = 2 * r["m"] * 4 * 3 * 64 * 32  # every token on each of the 4 experts
        seconds = r["ms"] / 1e3
        assert r["gflops"] == pytest.approx(flops / seconds / 1e9)
        # a unit not measured in `limit` falls back to its fastest one, FP32 FMA here
        peak = limit[roofline.UNIT_FIELDS[r["unit"]]] or limit["fma_gflops"]
        assert r["of_peak"] == pytest.approx(flops / seconds / 1e9 / peak)
        floor = max(weight_bytes / 10e9, flops / (peak * 1e9))
        assert r["of_roof"] == pytest.approx(floor / seconds)


def test_table_marks_the_fastest_backend_of_each_m(capsys):
    names = backends.available_backends()
    assert tpe.main(TINY + ["--tokens", "1,9", "--backends", ",".join(names)]) == 0
    rows = [ROW.match(line) for line in capsys.readouterr().out.splitlines()]
    rows = [r.groups() for r in rows if r]
    assert sorted((int(r[1]), r[3]) for r in rows) == sorted((m, b) for m in (1, 9) for b in names)
    for m in (1, 9):
        group = [r for r in rows if int(r[1]) == m]
        assert len([r for r in group if r[2] == "*"]) == 1
        marked = next(r for r in group if r[2] == "*")
        assert float(marked[4]) == min(float(r[4]) for r in group)


def test_calls_route_m_tokens_to_every_expert():
    layer = L.Layer("tiny", 4, 4, 64, 32)
    seen = []

    class Recorder:
        def __call__(self, x, ids, weights):
            seen.append((x.shape, ids.copy(), weights.copy()))

    medians = tpe.time_calls([Recorder(), Recorder()], layer.experts, [1, 3], rounds=2, hidden=64)
    assert sorted(medians) == [1, 3] and all(s >= 0 for s in medians.values())
    # warm-up: each m on each copy; then per round and m the copies walked to MIN_CALLS calls
    assert len(seen) == 2 * 2 + 2 * 2 * tpe.MIN_CALLS
    for shape, ids, weights in seen:
        m = shape[0]
        assert shape == (m, 64) and m in (1, 3)
        assert (np.sort(ids, axis=1) == np.arange(4)).all()  # each token on each expert once
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_before_round_runs_ahead_of_each_rounds_calls():
    events = []

    class Recorder:
        def __call__(self, x, ids, weights):
            events.append(("call", x.shape[0]))

    tpe.time_calls([Recorder()], 4, [1, 3], rounds=3, hidden=64, before_round=lambda: events.append(("probe",)))
    warm_up, timed = events[:2], events[2:]
    assert ("probe",) not in warm_up
    per_round = 1 + 2 * tpe.MIN_CALLS  # the probe, then each m walked to MIN_CALLS calls
    assert len(timed) == 3 * per_round
    for r in range(3):
        assert timed[r * per_round] == ("probe",)
        assert ("probe",) not in timed[r * per_round + 1:(r + 1) * per_round]


def test_the_rows_roofline_uses_the_read_bandwidth_probed_between_rounds(capsys, monkeypatch):
    # the limits pass reads 1000 GB/s, every probe between rounds 0.001 GB/s: the rows must sit on the latter
    monkeypatch.setattr(tpe, "measure_limits", lambda counts, nbytes, log: {
        n: roofline.Roofline(threads=n, read_gbs=1000.0, fma_gflops=1e6, dpbf16_gflops=None) for n in counts})
    monkeypatch.setattr(roofline, "read_bandwidth", lambda threads, buf=None, repeats=5, nbytes=0: 0.001)
    assert tpe.main(TINY + ["--tokens", "1", "--backends", "reference"]) == 0
    out = capsys.readouterr().out
    assert "reference, 1 thread(s): read 0.0 GB/s between its rounds" in out
    (row,) = [r.groups() for r in map(ROW.match, out.splitlines()) if r]
    # memory floor = 4 x 3 x 64 x 32 bytes / 1 MB/s = 24.6 ms, far above any call of this tiny layer
    assert int(row[8]) > 100


def test_a_cpu_without_a_compute_peak_gets_the_memory_floor_alone(capsys):
    layer = L.Layer("tiny", 4, 4, 64, 32)
    # as measured without AVX2: no FMA peak, no other unit
    limit = dict(threads=1, read_gbs=10.0, fma_gflops=0.0, dpbf16_gflops=None, amx_gflops=None, fma512_gflops=None)
    experts = L.random_experts(layer, "fp8_per_channel")
    seconds_by_m = tpe.time_calls([Ktfp8Side(layer, experts, "reference", 1)], 4, [2], 1, 64)
    rows = tpe.rows_for(layer, 4 * 3 * 64 * 32, "reference", 1, seconds_by_m, limit)
    (row,) = rows
    assert row["of_peak"] is None
    assert row["of_roof"] == pytest.approx(4 * 3 * 64 * 32 / 10e9 / (row["ms"] / 1e3))
    assert " - " in tpe.table(rows).splitlines()[1]


@pytest.mark.parametrize("args, message", [
    (["--backends", "no_such_backend"], "not usable here"),
    (["--tokens", "0"], "positive integers"),
    (["--format", "fp4"], "invalid choice"),
    (["--experts", "-2"], "positive integer"),
])
def test_bad_arguments_are_refused_with_the_reason(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        tpe.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
