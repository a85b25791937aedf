"""The loss bench's cases and inputs (bench/cases.py): case ids, and the soft target kinds built from the same logits
and class indices."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.cases import TARGET_KINDS, Case, SoftTarget, make_inputs  # noqa: E402
from calibkernels import reference as ck_reference  # noqa: E402

KINDS = TARGET_KINDS


def test_soft_target_kinds_share_the_logits_and_keep_the_hard_ids():
    hard = Case(37, 19, "fp32", "brier", "grad", "cpu")
    assert hard.id == "cpu-37x19-fp32-brier-grad" and hard.target == "hard" and hard.hard is hard
    with pytest.raises(ValueError, match="target kind"):
        Case(8, 4, target="onehot")
    leaf, y = make_inputs(hard, seed=3)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.int64
    soft = {}
    for kind in KINDS[1:]:
        case = Case(37, 19, "fp32", "brier", "grad", "cpu", kind)
        assert case.id == f"{hard.id}-{kind}" and case.hard == hard
        logits, soft[kind] = make_inputs(case, seed=3)
        assert torch.equal(logits, leaf) and isinstance(soft[kind], SoftTarget) and soft[kind].kind == kind
    assert torch.equal(soft["smooth"].target, y) and soft["smooth"].kwargs == {"label_smoothing": 0.1}
    mix = soft["mix"].kwargs
    assert set(mix) == {"mix_target", "mix_lambda"} and torch.equal(mix["mix_target"], y.flip(0))
    lam = mix["mix_lambda"]
    assert lam.shape == (37,) and lam.dtype == torch.float32 and bool(((lam >= 0) & (lam <= 1)).all())
    assert lam.unique().numel() > 30  # one lambda per row
    assert torch.equal(lam, make_inputs(Case(37, 19, target="mix"), seed=3)[1].kwargs["mix_lambda"])
    assert soft["mix_smooth"].kwargs["label_smoothing"] == 0.1 and torch.equal(soft["mix_smooth"].kwargs["mix_lambda"],
                                                                               lam)
    dense = soft["dense"]
    assert dense.kwargs == {} and dense.target.shape == (37, 19) and dense.target.dtype == torch.float32
    torch.testing.assert_close(dense.target.double().sum(1), torch.ones(37, dtype=torch.float64))
    # the dense target is the dense form of "mix_smooth": the same loss and gradient in float64
    z = leaf.detach().double()
    compact = ck_reference.uncertainty_weighted_ce(z, y, **soft["mix_smooth"].kwargs)
    torch.testing.assert_close(ck_reference.uncertainty_weighted_ce(z, dense.target.double()), compact, rtol=1e-6,
                               atol=0)
    assert Case(37, 19, target="dense").min_traffic_bytes == 2 * hard.nc_bytes + 37 * 19 * 4
