"""``calibkernels.losses``: the registry accepts exactly each loss's hyper-parameters, validates their values, and
builds every call that the READMEs document."""

import ast
import math
import re
from pathlib import Path

import pytest
import torch

import calibkernels as ck
from calibkernels import reference as R

ROOT = Path(__file__).resolve().parents[1]

# name -> the hyper-parameters its loss uses (besides reduction, ignore_index, backend, and inplace where fused)
USED = {
    "cross_entropy": set(),
    "focal_loss": {"gamma"}, "focal_loss_gra": {"gamma"}, "flsd": {"gamma"}, "flsd_gra": {"gamma"},
    "dual_focal_loss": {"gamma"}, "dual_focal_loss_gra": {"gamma"},
    "bsce": {"gamma", "norm"}, "bsce_gra": {"gamma", "norm"},
    "brier_loss": set(),
    "label_smoothing": {"alpha"},
    "mmce": {"lam", "bandwidth"}, "mmce_weighted": {"lam", "bandwidth"},
    "soft_target_cross_entropy": set(), "soft_target_bsce_gra": {"gamma", "norm"},
    "bsce_adaptive_gra": {"gamma", "norm"},
    "adafocal": {"n_bins", "lam", "gamma_initial", "gamma_max", "gamma_min", "switch_point"},
    "mdca": {"beta", "base"},
    "mbls": {"margin", "lam"},
}
SAMPLE_VALUE = {"gamma": 2.0, "norm": 1.5, "alpha": 0.1, "lam": 3.0, "bandwidth": 0.3, "beta": 3.0,
                "base": "focal_loss", "margin": 2.0, "n_bins": 5, "gamma_initial": 2.0, "gamma_max": 1.0,
                "gamma_min": 0.5, "switch_point": 0.9}
# AdaFocal's update hyper-parameters act only through update() (tests/test_more_losses.py checks them there)
ACTS_AFTER_UPDATE = {"adafocal": {"n_bins", "lam", "gamma_max", "gamma_min", "switch_point"}}
# held fixed while another hyper-parameter changes, so that the one changed acts on these inputs
CONTEXT = {"mbls": {"margin": 1.0}}


def _inputs(n=10, c=5):
    z, y = torch.randn(n, c, dtype=torch.float64) * 2, torch.randint(0, c, (n,))
    z[0] = 0.0
    z[0, y[0]] = 2.0  # p_y = e² / (e² + c - 1) ≥ 0.5 for c ≤ 8: a row where FLSD uses its γ argument
    return z, y


def test_registry_table_covers_every_name():
    assert set(USED) == set(ck.losses.names())


@pytest.mark.parametrize("name", sorted(USED))
def test_each_name_rejects_the_hyperparameters_it_does_not_use(name):
    for unused in sorted(set(SAMPLE_VALUE) - USED[name]):
        with pytest.raises(TypeError, match=rf"{name}.*{unused}") as info:
            ck.losses.build(name, **{unused: SAMPLE_VALUE[unused]})
        for accepted in USED[name] | {"reduction", "ignore_index"}:  # the message names what is accepted
            assert accepted in str(info.value), (name, unused, str(info.value))
    for wrong in ("weight", "mode", "weighted", "lamda"):  # fixed by the name, or not the parameter's name
        with pytest.raises(TypeError, match=wrong):
            ck.losses.build(name, **{wrong: 1})


@pytest.mark.parametrize("name", sorted(USED))
def test_each_name_uses_the_hyperparameters_it_accepts(name):
    """Every accepted hyper-parameter reaches the loss: changing it changes the value (never silently ignored)."""
    z, y = _inputs()
    context = CONTEXT.get(name, {})
    base = ck.losses.build(name, backend="reference", **context)(z, y)
    for used in sorted(USED[name] - ACTS_AFTER_UPDATE.get(name, set())):
        hyperparameters = {**context, used: SAMPLE_VALUE[used]}
        changed = ck.losses.build(name, backend="reference", **hyperparameters)(z, y)
        assert not torch.allclose(changed, base), (name, used)
    total = ck.losses.build(name, backend="reference", reduction="sum", **context)(z, y)
    torch.testing.assert_close(total, base * len(y))


def test_cross_entropy_gamma_is_rejected_not_ignored():
    with pytest.raises(TypeError, match=r"cross_entropy.*gamma.*accept"):
        ck.losses.build("cross_entropy", gamma=2)


def test_mmce_lam_is_the_trade_off_weight():
    z, y = _inputs(12, 4)
    for name, weighted in (("mmce", False), ("mmce_weighted", True)):
        module = ck.losses.build(name, lam=2.5, backend="reference")
        assert module.lam == 2.5 and "lam=2.5" in repr(module)
        expected = torch.nn.functional.cross_entropy(z, y) + 2.5 * R.mmce(z, y, weighted=weighted)
        torch.testing.assert_close(module(z, y), expected)
        torch.testing.assert_close(R.mmce_loss(z, y, lam=2.5, weighted=weighted), expected)


BAD_LAM = [float("nan"), float("inf"), -float("inf"), -0.5]


@pytest.mark.parametrize("lam", BAD_LAM)
def test_mmce_rejects_a_lam_that_is_not_finite_and_non_negative(lam):
    z, y = _inputs()
    for name in ("mmce", "mmce_weighted"):
        with pytest.raises(ValueError, match="lam"):
            ck.losses.build(name, lam=lam)
        with pytest.raises(ValueError, match="lam"):
            ck.losses.MMCELoss(lam=lam)
    with pytest.raises(ValueError, match="lam"):
        R.mmce_loss(z, y, lam=lam)
    with pytest.raises(TypeError, match="lam"):
        ck.losses.build("mmce", lam=True)  # a bool is not a weight


@pytest.mark.parametrize("bandwidth", [float("nan"), float("inf"), 0.0, -1.0])
def test_mmce_rejects_a_bandwidth_that_is_not_finite_and_positive(bandwidth):
    z, y = _inputs()
    with pytest.raises(ValueError, match="bandwidth"):
        ck.losses.build("mmce", bandwidth=bandwidth)
    with pytest.raises(ValueError, match="bandwidth"):
        R.mmce(z, y, bandwidth=bandwidth)
    with pytest.raises(ValueError, match="bandwidth"):
        R.mmce_loss(z, y, bandwidth=bandwidth)


@pytest.mark.parametrize("gamma", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("name", [n for n in sorted(USED) if "gamma" in USED[n]])
def test_modules_reject_a_gamma_that_is_not_finite_and_non_negative(name, gamma):
    with pytest.raises(ValueError, match="gamma"):
        ck.losses.build(name, gamma=gamma)
    with pytest.raises(ValueError, match="gamma"):
        ck.losses.UncertaintyWeightedCE(uncertainty="focal", gamma=gamma)


@pytest.mark.parametrize("norm", [float("nan"), float("inf"), 0.0])
def test_modules_reject_a_norm_that_is_not_finite_and_positive(norm):
    with pytest.raises(ValueError, match="norm"):
        ck.losses.build("bsce_gra", norm=norm)


@pytest.mark.parametrize("ignore_index", [1.5, "-100", True, None])
def test_modules_reject_an_ignore_index_that_is_not_an_int_when_built(ignore_index):
    """At construction, as the functional call does at its call: not at the first forward."""
    for make in (ck.losses.UncertaintyWeightedCE, ck.losses.SoftTargetUncertaintyWeightedCE,
                 ck.losses.FusedLinearUncertaintyWeightedCE):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            make(ignore_index=ignore_index)
    for name in ck.losses.names():
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            ck.losses.build(name, ignore_index=ignore_index)


def test_modules_reject_bad_types_when_built_and_show_a_non_default_ignore_index():
    with pytest.raises(TypeError, match="inplace must be a bool"):
        ck.losses.build("bsce_gra", inplace="no")
    for alpha in (True, "0.1"):
        with pytest.raises(TypeError, match="alpha must be a number"):
            ck.losses.build("label_smoothing", alpha=alpha)
    for name in ck.losses.names():
        assert "ignore_index=3" in repr(ck.losses.build(name, ignore_index=3)), name
        assert "ignore_index" not in repr(ck.losses.build(name)), name


# ------------------------------------------------------------------------------------------------------------------
# The calls the READMEs document
# ------------------------------------------------------------------------------------------------------------------
def _readme_build_calls():
    """``ck.losses.build("name", key=value, ...)`` written in README.md, as (name, hyper-parameters)."""
    calls = []
    for call in re.findall(r"ck\.losses\.build\(([^)]*)\)", (ROOT / "README.md").read_text()):
        try:
            node = ast.parse(f"f({call})", mode="eval").body
        except SyntaxError:
            continue
        if not node.args or not isinstance(node.args[0], ast.Constant):
            continue  # the signature line ck.losses.build(name, **hyperparameters)
        calls.append((node.args[0].value, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}))
    return calls


def _training_readme_loss_specs():
    """The ``--loss NAME:KEY=VALUE:...`` examples of training/README.md, parsed as training/train.py does."""
    text = (ROOT / "training" / "README.md").read_text()
    sentence = re.search(r"`--loss` takes.*?;", text, flags=re.S).group(0)
    from training.train import parse_loss_spec

    return [parse_loss_spec(spec) for spec in re.findall(r"`([a-z_]+(?::[a-z_]+=[^:`]+)*)`", sentence)]


def test_documented_examples_are_found():
    assert ("dual_focal_loss", {"gamma": 5.0}) in _readme_build_calls()
    specs = _training_readme_loss_specs()
    assert ("mmce_weighted", {"lam": 2}) in specs and len(specs) >= 5, specs


@pytest.mark.parametrize("name, hyperparameters", _readme_build_calls() + _training_readme_loss_specs(),
                         ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_documented_build_calls_work(name, hyperparameters):
    for reduction in ("mean", "sum"):  # training/train.py adds the recipe's reduction
        module = ck.losses.build(name, reduction=reduction, **hyperparameters)
        for key, value in hyperparameters.items():
            got = getattr(module, key)
            assert got == value if isinstance(value, str) else math.isclose(got, value), (name, key)
        z, y = _inputs()
        module.backend = "reference"
        x = z.clone().requires_grad_()
        loss = module(x, y)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("form", ["kumar", "papers_code"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mmce_of_a_batch_with_every_row_ignored_is_zero(weighted, form, reduction):
    """No row to compare: the loss and its gradient are 0 in every form (the unweighted Kumar form had returned
    λ·sqrt(1e-10) = 2e-5, from the 1e-10 that keeps the square root's gradient finite)."""
    z = torch.randn(4, 5, requires_grad=True)
    loss = ck.losses.build("mmce_weighted" if weighted else "mmce", form=form, reduction=reduction)(
        z, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and (z.grad == 0).all()


@pytest.mark.parametrize("name,kwargs", [
    ("focal_loss", {"gamma": 2.0}), ("bsce_gra", {"gamma": 4.0, "norm": 2}), ("label_smoothing", {"alpha": 0.25}),
    ("mmce", {"lam": 2.0}), ("mbls", {"margin": 5.0}), ("mdca", {"beta": 1.0}), ("adafocal", {"lam": 1.0}),
])
def test_numpy_scalar_hyperparameters_build_the_same_loss(name, kwargs):
    """A NumPy float or integer (e.g. from a config parsed with numpy) is a number like a Python one: the same module,
    the same repr and loss (they had been refused with 'must be a number, got float32'); a bool is still refused.
    (Values a float32 holds exactly, so that both spellings are the same number.)"""
    np = pytest.importorskip("numpy")
    z, y = torch.randn(8, 5), torch.randint(0, 5, (8,))
    as_numpy = {k: (np.float32(v) if isinstance(v, float) else np.int64(v)) for k, v in kwargs.items()}
    built, reference = ck.losses.build(name, **as_numpy), ck.losses.build(name, **kwargs)
    assert repr(built) == repr(reference)
    torch.testing.assert_close(built(z, y), reference(z, y))
    key = next(iter(kwargs))
    with pytest.raises(TypeError, match=key):
        ck.losses.build(name, **{key: np.bool_(True)})


# ------------------------------------------------------------------------------------------------------------------
# F.cross_entropy / Liger-Kernel options of the modules: weight (a buffer), lse_square_scale, softcap, return_z_loss
# ------------------------------------------------------------------------------------------------------------------
def _auto(call, *args):
    """``backend="auto"`` runs these options on the reference for now, with a RuntimeWarning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return call(*args)


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_class_weights_of_the_module_match_cross_entropy_loss(backend, reduction, label_smoothing):
    """``uncertainty="none"`` with ``weight=w`` is ``nn.CrossEntropyLoss(weight=w)``: values and gradients, with
    ignored rows and label smoothing (the weighted mean over Σ w_y)."""
    g = torch.Generator().manual_seed(7)
    z, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (12,), generator=g)
    y[[2, 9]] = -100
    w = torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    module = ck.losses.UncertaintyWeightedCE(uncertainty="none", weight=w, reduction=reduction, backend=backend,
                                             label_smoothing=label_smoothing)
    torch_loss = torch.nn.CrossEntropyLoss(weight=w, reduction=reduction, label_smoothing=label_smoothing)
    x, x_torch = z.clone().requires_grad_(), z.clone().requires_grad_()
    got, want = _auto(module, x, y), torch_loss(x_torch, y)
    torch.testing.assert_close(got, want)
    go = torch.randn(want.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(got, x, go)[0], torch.autograd.grad(want, x_torch, go)[0])
    # probability targets: the soft-target module against CrossEntropyLoss's weighted rows and mean over N
    probabilities = torch.softmax(torch.randn(12, 5, generator=g, dtype=torch.float64), dim=1)
    soft = ck.losses.SoftTargetUncertaintyWeightedCE(uncertainty="none", weight=w, reduction=reduction,
                                                     backend=backend, label_smoothing=label_smoothing)
    torch.testing.assert_close(_auto(soft, z, probabilities), torch_loss(z, probabilities))


def test_module_class_weights_combine_with_the_uncertainty_weight_as_the_functional_call():
    z, y = _inputs(12, 5)
    y[3] = -100
    w = torch.tensor([0.5, 2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    for module, kw in ((ck.losses.UncertaintyWeightedCE(uncertainty="focal", mode="loss", gamma=2.0, weight=w,
                                                        backend="reference"),
                        dict(uncertainty="focal", mode="loss", gamma=2.0)),
                       (ck.losses.AdaptiveBSCEGRA(weight=w, backend="reference"),
                        dict(uncertainty="brier_flsd", mode="grad", gamma=3.0)),
                       (ck.losses.build("bsce_gra", backend="reference"), dict(uncertainty="brier"))):
        x, x_ref = z.clone().requires_grad_(), z.clone().requires_grad_()
        weight = module.weight
        want = R.uncertainty_weighted_ce(x_ref, y, weight=weight, **kw)
        got = module(x, y)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x_ref)[0])


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_module_z_loss_and_softcap_pass_through(backend):
    z, y = _inputs(12, 5)
    y[0] = -100
    w = torch.rand(5, dtype=torch.float64)
    options = dict(lse_square_scale=0.25, softcap=3.0, return_z_loss=True)
    for reduction in ("mean", "none"):
        module = ck.losses.UncertaintyWeightedCE(uncertainty="brier", mode="loss", reduction=reduction,
                                                 backend=backend, weight=w, **options)
        x, x_ref = z.clone().requires_grad_(), z.clone().requires_grad_()
        loss, z_loss = _auto(module, x, y)
        want, want_z_loss = R.uncertainty_weighted_ce(x_ref, y, uncertainty="brier", mode="loss", reduction=reduction,
                                                      weight=w, **options)
        torch.testing.assert_close((loss, z_loss), (want, want_z_loss))
        assert not z_loss.requires_grad and bool((z_loss[y != -100] > 0).all() if reduction == "none" else z_loss > 0)
        go = torch.ones_like(want)
        torch.testing.assert_close(torch.autograd.grad(loss, x, go)[0], torch.autograd.grad(want, x_ref, go)[0])
    # each alone changes the loss; with return_stats the statistics come last
    plain = ck.losses.UncertaintyWeightedCE(backend="reference")(z, y)
    for option in (dict(lse_square_scale=0.25), dict(softcap=1.0)):
        assert not torch.allclose(ck.losses.UncertaintyWeightedCE(backend="reference", **option)(z, y), plain), option
    out = ck.losses.UncertaintyWeightedCE(backend="reference", return_z_loss=True, return_stats=True)(z, y)
    assert len(out) == 3 and isinstance(out[2], ck.LossStats)
    torch.testing.assert_close(out[0], plain)
    assert out[1].item() == 0.0  # the z-loss at scale 0: returned, not added


def test_module_class_weights_are_a_buffer():
    """As ``nn.CrossEntropyLoss``'s: moved and cast with the module, in its state dict when given; a module without
    class weights has no such entry (state dicts saved before keep loading)."""
    w = torch.tensor([1.0, 2.0, 3.0])
    module = ck.losses.UncertaintyWeightedCE(weight=w)
    assert dict(module.named_buffers())["weight"] is w and "weight" in module.state_dict()
    module = module.to(torch.float64)
    assert module.weight.dtype == torch.float64 and module.weight.tolist() == [1.0, 2.0, 3.0]
    assert "weight" not in ck.losses.UncertaintyWeightedCE().state_dict()
    assert ck.losses.UncertaintyWeightedCE().weight is None
    loaded = ck.losses.UncertaintyWeightedCE(weight=torch.zeros(3))
    loaded.load_state_dict(module.state_dict())
    assert loaded.weight.tolist() == [1.0, 2.0, 3.0]


def test_module_drop_in_options_appear_in_its_repr():
    module = ck.losses.UncertaintyWeightedCE(weight=torch.ones(4), lse_square_scale=1e-4, softcap=30.0,
                                             return_z_loss=True)
    text = repr(module)
    for part in ("weight=<(4,) float32>", "lse_square_scale=0.0001", "softcap=30.0", "return_z_loss=True"):
        assert part in text, text
    plain = repr(ck.losses.UncertaintyWeightedCE())
    for key in ("weight=", "lse_square_scale", "softcap", "return_z_loss"):
        assert key not in plain
    assert "softcap=2.0" in repr(ck.losses.AdaptiveBSCEGRA(softcap=2))


def test_module_drop_in_options_are_checked_when_built():
    make = ck.losses.UncertaintyWeightedCE
    with pytest.raises(TypeError, match="uncertainty='focal'"):
        make(weight="focal")
    with pytest.raises(ValueError, match=r"shape \(C,\)"):
        make(weight=torch.ones(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        make(weight=torch.ones(3, dtype=torch.long))
    with pytest.raises(TypeError, match="per-class weights"):
        make(weight=[1.0, 2.0])
    with pytest.raises(ValueError, match="entry 1"):
        make(weight=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="requires grad"):
        make(weight=torch.ones(3, requires_grad=True))
    with pytest.raises(ValueError, match="lse_square_scale"):
        make(lse_square_scale=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        make(softcap=0.0)
    with pytest.raises(TypeError, match="return_z_loss"):
        make(return_z_loss=1)
    # the length is the logits' C, checked at the call
    with pytest.raises(ValueError, match="shape"):
        make(weight=torch.ones(4, dtype=torch.float64), backend="reference")(*_inputs(6, 5))
