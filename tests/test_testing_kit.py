"""The public layout-invariance kit (``twinkle_megatron.testing``) on the user metric of docs/testing.md.

The page's metric (Twinkle's "Building Metrics" pattern) is taken from the page itself, so that
what the page shows is what is tested: the kit passes it on every default layout, and catches
the same metric with a wrong reduction (per-rank means averaged, per-microbatch means averaged),
a wrong host-sync budget and a host sync where none is allowed, each with a message that names
the layout, the variant and the key.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_megatron.parallel import Layout
from twinkle_megatron.testing.guards import HostSyncError
from twinkle_megatron.testing.invariance import LAYOUTS, assert_layout_invariant, assert_matches

PAGE = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@pytest.fixture(scope="module")
def page():
    """The namespace of the page's first block: ``LabelLogProb``, ``batch``, ``feed``, and the ``runs`` of its
    check on the default layouts (which passed, or the block would have raised)."""
    namespace = {"__name__": "docs_testing"}
    exec(compile(FENCE.findall(PAGE.read_text())[0], str(PAGE), "exec"), namespace)
    return namespace


def test_the_page_metric_passes_on_every_default_layout_with_its_counts(page):
    runs = page["runs"]
    assert list(runs) == list(LAYOUTS)
    for layout, per_rank in runs.items():
        assert len(per_rank) == layout.world_size
        for rank_runs in per_rank:
            for microbatches, run in zip((1, 2), rank_runs):
                assert run.calculate_collectives == {"all_gather": 2}
                assert run.accumulate_collectives == {}
                # Only the last stage is fed; there each call makes two host syncs (float(), int()).
                assert run.calls == (microbatches if run.fed else 0)
                assert len(run.host_syncs) == 2 * run.calls
    batch = page["batch"]
    pooled = float(batch["logps"][batch["labels"] != -100].mean())  # Σ log p / Σ tokens, in one process
    assert runs[Layout(dp=2)][1][0].result["label_logprob"] == pytest.approx(pooled, rel=1e-12)


def test_averaging_the_ranks_means_is_caught_on_the_data_parallel_layout(page):
    class MeanOfRankMeans(page["LabelLogProb"]):
        def calculate(self):  # wrong: every rank weighs the same, however many tokens it holds
            parts = self.gather_results([(self.logprob_sum, self.tokens)])
            self.reset()
            return {"label_logprob": sum(s / n for s, n in parts) / len(parts)}

    with pytest.raises(AssertionError, match=r"^tp1_pp1_cp1_dp2, variant 1 \['label_logprob'\]: reports -2\.62\d*, "
                                             r"the single process -2\.60\d* \(rel 1e-12\)$"):
        assert_layout_invariant(lambda _: MeanOfRankMeans(), page["batch"], feed=page["feed"], variants=(1, 2),
                                rel=1e-12, host_syncs_per_call=2)


def test_averaging_the_microbatches_means_is_caught_by_the_microbatch_variants(page):
    class MeanOfCallMeans(page["LabelLogProb"]):
        def reset(self):
            super().reset()
            self.means = []

        def accumulate(self, inputs, outputs):  # wrong: a mean per call, the calls' means averaged
            counted = inputs["labels"] != -100
            self.means.append(float((outputs["logps"] * counted).sum()) / int(counted.sum()))

        def calculate(self):
            means = self.gather_results(self.means)
            self.reset()
            return {"label_logprob": sum(means) / len(means)}

    # The same wrong mean in one process and on every layout, for the same split: the splits must agree.
    assert_layout_invariant(lambda _: MeanOfCallMeans(), page["batch"], [Layout(tp=2)], feed=page["feed"],
                            variants=(1, 2), rel=1e-12, allow_host_syncs=True)
    with pytest.raises(AssertionError, match=r"^single process, variant 2 \['label_logprob'\]: reports -2\.62\d*, "
                                             r"variant 1 -2\.60\d* \(rel 1e-12\)$"):
        assert_layout_invariant(lambda _: MeanOfCallMeans(), page["batch"], [Layout(tp=2)], feed=page["feed"],
                                variants=(1, 2), rel=1e-12, allow_host_syncs=True, variants_agree=True)


def test_a_wrong_host_sync_budget_names_the_syncs(page):
    with pytest.raises(AssertionError, match=r"^tp1_pp1_cp1_dp2, variant 1: rank 0 made 2 host syncs in 1 "
                                             r"accumulate calls, not 1 per call: \['aten::_local_scalar_dense', "):
        assert_layout_invariant(lambda _: page["LabelLogProb"](), page["batch"], [Layout(dp=2)], feed=page["feed"],
                                variants=(1,), host_syncs_per_call=1)


def test_host_syncs_fail_the_check_unless_allowed(page):
    # The single-process reference runs first, in this process: the guard raises there, at the first sync.
    with pytest.raises(HostSyncError, match="host sync: aten::_local_scalar_dense"):
        assert_layout_invariant(lambda _: page["LabelLogProb"](), page["batch"], [Layout(dp=2)], feed=page["feed"],
                                variants=(1,))


def test_wrong_collective_counts_are_reported(page):
    with pytest.raises(AssertionError, match=r"rank 0 issued \{'all_gather': 2\} in calculate, not "
                                             r"\{'all_reduce': 1\}"):
        assert_layout_invariant(lambda _: page["LabelLogProb"](), page["batch"], [Layout(dp=2)], feed=page["feed"],
                                variants=(1,), allow_host_syncs=True, calculate_collectives={"all_reduce": 1})


@pytest.mark.parametrize(("got", "want", "rel", "same"), [
    (1.0 + 1e-6, 1.0, 1e-5, True), (1.0 + 1e-4, 1.0, 1e-5, False), (1e-13, 0.0, 1e-5, True),
    (1e-11, 0.0, 1e-5, False), (math.inf, math.inf, 1e-5, True), (1e300, math.inf, 1e-5, False),
    (math.nan, math.nan, 1e-5, False), (1, 1.0, 1e-5, True), (None, 1.0, 1e-5, False), ("1.0", 1.0, 1e-5, False),
    (1.0 + 1e-15, 1.0, 0, False), (3, 3, 1e-5, True), (True, 1, 1e-5, True)])
def test_floats_match_as_pytest_approx_does(got, want, rel, same):
    """The package's comparison needs no pytest; it agrees with ``pytest.approx`` (relative ``rel``, absolute
    1e-12, NaN never close, infinities only themselves; ``rel=0`` and non-floats: exactly)."""
    if isinstance(want, float) and rel and isinstance(got, (int, float)):
        assert (got == pytest.approx(want, rel=rel)) is same
    if same:
        assert_matches({"key": got}, {"key": want}, rel=rel)
    else:
        with pytest.raises(AssertionError, match=r"^where \['key'\]: reports "):
            assert_matches({"key": got}, {"key": want}, rel=rel, where="where")


def test_the_kit_imports_neither_megatron_nor_pytest():
    """megatron-core is imported when ranks start with a layout; pytest is never needed."""
    code = ("import sys; import twinkle_megatron.testing.invariance, twinkle_megatron.testing.guards; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'pytest'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
