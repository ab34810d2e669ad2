"""`python -m eqx_longctx.selftest` passes on this CPU, and fails when an implementation is
wrong, raises, or a result is NaN."""

import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHILD_XLA_FLAGS

from eqx_longctx import selftest
from eqx_longctx.attention import XlaBlockImpl
from eqx_longctx.attention._block import AbstractBlockImpl
from eqx_longctx.selftest import _attention, _kernels, _report

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(?P<case>\S.*?)\s{2,}.*\s(?P<result>PASS|FAIL|VMEM-OOM|MOSAIC|OTHER)\b", re.M)


def _run_selftest(*flags: str) -> str:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # the selftest makes its own 8 devices
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_longctx.selftest", *flags], capture_output=True, text=True,
        env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for line in ("jax ", "jaxlib ", "backend          cpu", "devices          8"):
        assert line in out, out
    assert re.search(
        r"^case\s+impl\s+vs\s+max errors \(relative\)\s+tol\s+time\s+result$", out, re.M
    )
    assert "pallas 128x128 tpu-interpret  xla" in out  # the kernels held against XLA
    assert re.search(r"all passed$", out.strip())
    return out


def test_selftest_cases_and_ring_pass_on_cpu():
    # The CI tier: two attention cases (the MLA one at bf16) and the ring, no train steps.
    out = _run_selftest("--quick", "--case", "causal", "--case", "m-mla")
    rows = ROW.findall(out)
    cases = [case for case, _ in rows]
    for name in ("causal f32", "m-mla bf16 b2 s256 h2/2 d192/128", "ring of 8"):
        assert any(c.startswith(name) for c in cases), (name, out)
    assert not any(c.startswith("train") for c in cases), out
    assert len(rows) == 2 * 3 + 1 and all(r == "PASS" for _, r in rows), out


@pytest.mark.slow
def test_selftest_passes_on_cpu():
    # Every case, the kernel properties and the rerun (~140 s): the full tier.
    out = _run_selftest()
    rows = ROW.findall(out)
    cases = [case for case, _ in rows]
    for name in ("causal f32", "window f32", "packed f32", "gqa bf16", "ring of 8", "train",
                 "m-mla bf16 b2 s256 h2/2 d192/128", "m-mqa f32 b1 s256 h4/1 d256",
                 "no visible key", "rerun"):  # fmt: skip
        assert any(c.startswith(name) for c in cases), (name, out)
    n_cases = len(_attention.CASES) + len(_attention.MATRIX)
    assert len(rows) == n_cases * 3 + 2 + 1 + 1 and all(r == "PASS" for _, r in rows), out
    for line in (r"kernel VMEM\s+16 MiB per core", r"kernel blocks\s+512 x 512", r"libtpu\s+\S"):
        assert re.search(line, out), out


class _OffByOnePercent(AbstractBlockImpl):
    """The XLA block function with every output 1% too large: a wrong implementation."""

    inner: AbstractBlockImpl

    def tile_queries(self, q, positions, segment_ids, kv_like, options):
        return self.inner.tile_queries(q, positions, segment_ids, kv_like, options)

    def attend(self, qt, k, v, kv_positions, kv_segment_ids):
        out, lse = self.inner.attend(qt, k, v, kv_positions, kv_segment_ids)
        return out * 1.01, lse

    def attend_backward(self, qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq):
        return self.inner.attend_backward(
            qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq
        )


class _Raises(_OffByOnePercent):
    def tile_queries(self, q, positions, segment_ids, kv_like, options):
        raise RuntimeError("Mosaic failed to compile\nsecond line")


def test_a_wrong_implementation_fails_the_selftest(monkeypatch, capsys):
    xla = XlaBlockImpl()
    impls = {"wrong": _OffByOnePercent(xla), "broken": _Raises(xla), "xla": xla}
    monkeypatch.setattr(_attention, "implementations", lambda platform: impls)
    assert selftest.main(["--quick", "--case", "causal"]) == 1
    out = capsys.readouterr().out
    rows = {
        tuple(line.split()[6:9]): line for line in out.splitlines() if line.startswith("causal f32")
    }
    assert re.search(r" out 1\.0e-02 .*FAIL: out, .*above 1e-04$", rows[("wrong", "f32", "ref")])
    assert re.search(
        r"MOSAIC: RuntimeError: Mosaic failed to compile$", rows[("broken", "f32", "ref")]
    )
    assert rows[("xla", "f32", "ref")].endswith("PASS")
    assert re.search(r"FAIL: out, .*above 1e-04$", rows[("wrong", "xla", "out")])
    ring = [line for line in out.splitlines() if line.startswith("ring of 8")]
    assert len(ring) == 1 and "FAIL" in ring[0] and " wrong " in ring[0]
    assert re.search(r"did not pass$", out.strip())


def test_errors_measure_nan_and_misplaced_infinities():
    ref = np.array([[1.0, -np.inf], [2.0, 4.0]], np.float32)
    assert _report.rel_err(ref, ref) == 0.0
    assert _report.rel_err(ref * 1.5, ref) == pytest.approx(2.0 / 4.0)
    assert _report.rel_err(np.where(ref == 2.0, np.nan, ref), ref) == float("inf")
    assert _report.rel_err(np.where(np.isinf(ref), 0.0, ref), ref) == float("inf")
    row = _report.run_check("c", "i", "ref", 1e-4, lambda: {"out": float("nan")})
    assert row.status == "FAIL" and not row.ok


class _Shifted(_OffByOnePercent):
    def attend(self, qt, k, v, kv_positions, kv_segment_ids):
        out, lse = self.inner.attend(qt, k, v, kv_positions, kv_segment_ids)
        return out + 1e-3, lse


def test_kernel_property_rows_catch_a_wrong_implementation():
    """Rows that see no key must give exact zeros: an output shifted by 1e-3 fails; the XLA
    path passes, and its reruns are bitwise equal."""
    xla = XlaBlockImpl()
    sizes = _attention.sizes_for("cpu")
    assert _kernels.empty_rows_row({"xla": xla}, sizes).status == "PASS"
    row = _kernels.empty_rows_row({"shifted": _Shifted(xla)}, sizes)
    assert row.status == "FAIL" and "out" in row.note, row
    assert _kernels.bitwise_row({"xla": xla}, sizes).status == "PASS"


def test_splash_timing_row_runs_in_interpret_mode():
    """The TPU timing row's code, at a small size with splash interpreted: a PASS row with
    both TFLOP/s figures."""
    xla = XlaBlockImpl()
    row = _kernels.splash_timing_row({"xla": xla}, seq=256, heads=2, dim=128, interpret=True)
    assert row.status == "PASS", row
    assert re.fullmatch(r"fwd\+bwd \S+ TFLOP/s, splash \S+ \(\S+x\)", str(row.errors)), row


def test_errors_are_labelled_by_what_failed():
    oom = "RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem while allocating on stack"
    assert _report.error_label(RuntimeError(oom)) == "VMEM-OOM"
    assert _report.error_label(RuntimeError("Mosaic failed to compile TPU kernel")) == "MOSAIC"
    assert _report.error_label(ValueError("shapes (2,) and (3,) do not match")) == "OTHER"

    def raises():
        raise RuntimeError(oom + "\nsecond line")

    row = _report.run_check("c", "i", "ref", 1e-4, raises)
    assert row.status == "VMEM-OOM" and not row.ok and row.note.endswith("on stack")
    assert _report.tolerance(jnp.bfloat16) == 2e-2 and _report.tolerance(jnp.float32) == 1e-4
