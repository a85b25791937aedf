"""What the loss bench measures: cases (logits shape, dtype, loss, device, target kind), suites, and their inputs.

A case is one training step of the loss, forward + backward, for logits ``(N, C)`` and int64 targets, i.e.
``loss = f(logits, target); loss.backward()``, until the gradient sits in ``leaf.grad``.

Targets (``Case.target``, :data:`TARGET_KINDS`): ``"hard"`` class indices, or one of the soft forms of docs/losses.md
"Soft targets", built by :func:`make_inputs` from the same class indices: ``"smooth"`` (``label_smoothing=0.1``),
``"mix"`` (``mix_target = target.flip(0)``, one ``mix_lambda`` per row drawn from Beta(0.2, 0.2) with a fixed seed),
``"mix_smooth"`` (both) and ``"dense"`` (the float32 ``(N, C)`` distribution of ``"mix_smooth"``, as
``timm.data.Mixup`` builds it). A soft case's target is a :class:`SoftTarget`; the steps call
``f(logits, soft.target, **soft.kwargs)``. Cases that differ only in their target kind share the logits and are timed
together, interleaved (:func:`bench.measure.bench_cases`), so a run compares the kinds as it compares providers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MEASURES = ("step", "host_step")
# Target kinds (Case.target): class indices, and the soft forms of docs/losses.md "Soft targets" (make_inputs)
TARGET_KINDS = ("hard", "smooth", "mix", "mix_smooth", "dense")
LABEL_SMOOTHING = 0.1  # label_smoothing of the "smooth" and "mix_smooth" kinds (and in the "dense" distribution)
MIX_ALPHA = 0.2  # the mixes' per-row lambda ~ Beta(MIX_ALPHA, MIX_ALPHA) (mixup's alpha for ImageNet)
DENSE_TARGET_DTYPE = torch.float32  # what timm.data.Mixup builds, whatever the logits' dtype


@dataclass(frozen=True)
class Case:
    """One benchmark input: logits ``(n, c)`` of ``dtype`` on ``device``, loss ``weight``/``mode`` (mean reduction),
    targets of kind ``target`` (:data:`TARGET_KINDS`)."""

    n: int
    c: int
    dtype: str = "fp32"  # a key of DTYPES
    weight: str = "brier"
    mode: str = "grad"
    device: str = "cpu"
    target: str = "hard"  # a kind of TARGET_KINDS

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if self.target not in TARGET_KINDS:
            raise ValueError(f"unknown target kind {self.target!r}; expected one of {TARGET_KINDS}")
        if self.n <= 0 or self.c <= 0:
            raise ValueError(f"N and C must be positive, got ({self.n}, {self.c})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def id(self) -> str:
        """``<device>-<N>x<C>-<dtype>-<weight>-<mode>``, then ``-<target>`` for a soft target kind (hard cases keep the
        ids of the runs before target kinds existed)."""
        suffix = "" if self.target == "hard" else f"-{self.target}"
        return f"{self.device}-{self.n}x{self.c}-{self.dtype}-{self.weight}-{self.mode}{suffix}"

    @property
    def hard(self) -> "Case":
        """The same case with class-index targets."""
        return self if self.target == "hard" else replace(self, target="hard")

    @property
    def nc_bytes(self) -> int:
        """Bytes of one ``N×C`` buffer in the logits' dtype."""
        return self.n * self.c * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def min_traffic_bytes(self) -> int:
        """``2·N·C·bytes``: read the logits once, write the gradient once; plus the dense target, read once."""
        dense = self.n * self.c * DENSE_TARGET_DTYPE.itemsize if self.target == "dense" else 0
        return 2 * self.nc_bytes + dense


def host_case_id(case: Case) -> str:
    """``<device>-<N>x<C>-<dtype>``: a host-step case pairs providers of different losses (each row's ``case`` says
    which loss its provider computed)."""
    return f"{case.device}-{case.n}x{case.c}-{case.dtype}"


# A step takes (logits, target) and runs forward + backward; it returns the loss tensor (callers detach it: a detach
# inside the step would be timed). ``target`` is what make_inputs made for the case: the int64 class indices for a
# hard case, a SoftTarget for a soft one.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_step(loss_fn: Callable[..., torch.Tensor], case: Case, **keywords) -> Step:
    """The step ``loss_fn(logits, target, **keywords).backward()``; for a soft case the target is a
    :class:`SoftTarget`, and the call is ``loss_fn(logits, soft.target, **keywords, **soft.kwargs)``."""
    if case.target == "hard":
        def step(logits, target):
            loss = loss_fn(logits, target, **keywords)
            loss.backward()
            return loss
    else:
        def step(logits, soft):
            loss = loss_fn(logits, soft.target, **keywords, **soft.kwargs)
            loss.backward()
            return loss

    return step


@dataclass(frozen=True)
class Suite:
    """Cases crossed with providers (each provider runs the cases it applies to).

    ``measure="step"``: the timed training step (fresh non-leaf logits per repetition, :mod:`bench.timing`).
    ``measure="host_step"``: the host cost of back-to-back eager steps on one reused leaf (:mod:`bench.timing`):
    every provider runs every case whatever its loss, once per entry of ``threads`` (``None``: the run's default
    thread count), compared per repetition with ``baseline``; ``reps`` is the suite's default number of repetitions
    (``--reps`` overrides it).
    """

    name: str
    cases: tuple[Case, ...]
    providers: tuple[str, ...]
    measure: str = "step"
    threads: tuple[int | None, ...] = (None,)
    baseline: str | None = None
    reps: int | None = None

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"unknown measure {self.measure!r}; expected one of {MEASURES}")
        if self.baseline is not None and self.baseline not in self.providers:
            raise ValueError(f"baseline {self.baseline!r} is not one of the suite's providers {self.providers}")


@dataclass(frozen=True)
class SoftTarget:
    """The target of a soft case (:func:`soft_target`): the loss is ``f(logits, target, **kwargs)``.

    ``target``: the int64 class indices ``(N,)``, or for kind ``"dense"`` the float32 ``(N, C)`` distribution;
    ``kwargs``: the keywords of ``ck.uncertainty_weighted_ce`` and of the reference, ``label_smoothing``,
    ``mix_target``, ``mix_lambda`` (empty for ``"dense"``)."""

    kind: str
    target: torch.Tensor
    kwargs: dict = field(default_factory=dict)


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | SoftTarget]:
    """Leaf logits ``(N, C)`` (``requires_grad``) ~ 𝒩(0, 2²), uniform targets in ``[0, C)``, on the case's device;
    for a soft case the target is the :class:`SoftTarget` of those class indices (:func:`soft_target`).

    A scale of 2 gives a spread of confidences (neither uniform softmax nor one-hot), so every branch of the weight
    is exercised; the values do not change the work of any provider. Generated with a fixed seed so every provider
    sees the same data, and every target kind the same logits and class indices.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = (2.0 * torch.randn(case.n, case.c, generator=generator)).to(device=case.device, dtype=case.torch_dtype)
    target = torch.randint(0, case.c, (case.n,), generator=generator).to(case.device)
    return logits.requires_grad_(), target if case.target == "hard" else soft_target(case, target, seed)


def _mix_lambdas(n: int, seed: int) -> torch.Tensor:
    """``n`` draws of Beta(MIX_ALPHA, MIX_ALPHA), float32, from a fixed seed (the global generator's state is kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.Beta(MIX_ALPHA, MIX_ALPHA).sample((n,)).float()


def soft_target(case: Case, target: torch.Tensor, seed: int = 0) -> SoftTarget:
    """The target of ``case.target``'s kind from the class indices ``target`` (docs/losses.md "Soft targets"):

    * ``"smooth"``: ``label_smoothing = LABEL_SMOOTHING`` (0.1);
    * ``"mix"``: ``mix_target = target.flip(0)`` (mixup's partner, the batch reversed) and one ``mix_lambda`` per row
      ~ Beta(0.2, 0.2) (float32, ``(N,)``, fixed seed): mixup draws one λ per batch, a number that reaches the kernels
      as a 0-dim λ tensor; one per row exercises the general path;
    * ``"mix_smooth"``: both;
    * ``"dense"``: the float32 ``(N, C)`` distribution of ``"mix_smooth"``, ``λ·s(e_y) + (1 − λ)·s(e_y2)`` with
      ``s(e) = (1 − α)·e + α/C``, as ``timm.data.Mixup`` builds its targets (float32 whatever the logits' dtype).
    """
    kind = case.target
    if kind == "hard":
        raise ValueError("a hard case's target is the class indices themselves")
    kwargs: dict = {}
    if kind in ("smooth", "mix_smooth"):
        kwargs["label_smoothing"] = LABEL_SMOOTHING
    if kind in ("mix", "mix_smooth", "dense"):
        kwargs["mix_target"] = target.flip(0)
        kwargs["mix_lambda"] = _mix_lambdas(case.n, seed).to(target.device)
    if kind != "dense":
        return SoftTarget(kind, target, kwargs)
    lam = kwargs["mix_lambda"].double()[:, None]
    off = LABEL_SMOOTHING / case.c
    first, second = (torch.full((case.n, case.c), off, dtype=torch.float64, device=target.device)
                     .scatter_(1, y[:, None], 1.0 - LABEL_SMOOTHING + off) for y in (target, kwargs["mix_target"]))
    return SoftTarget(kind, (lam * first + (1.0 - lam) * second).to(DENSE_TARGET_DTYPE))


def target_call(target: torch.Tensor | SoftTarget) -> tuple[torch.Tensor, dict]:
    """``(target, keywords)`` of the loss call for a case's target (:func:`make_inputs`)."""
    return (target.target, target.kwargs) if isinstance(target, SoftTarget) else (target, {})


def fresh_logits(leaf: torch.Tensor) -> torch.Tensor:
    """A non-leaf copy of the logits for one repetition (:mod:`bench.timing`: it stands in for a layer's output);
    resets ``leaf.grad``."""
    leaf.grad = None
    return leaf.clone()
