"""Flags and config of the training objectives beyond plain GRPO.

  off-policy correction  --use-tis / --tis-clip / --tis-clip-low, --aipo-delta, --eps-clip-c
  regularisers           --kl-loss-coef / --kl-loss-type (k3) against a frozen reference, --entropy-coef
  context distillation   --teacher-tau / --student-tau / --adv-tau with a context: --teacher-context,
                         --context-key, or the meta-teacher's own info (--distill-context additional_info)
  JSD self-distillation  --sdpo-alpha ...: JSD to the hint-conditioned self (SDPO: the same model with
                         the teacher's final info, or --sdpo-hint, in its prompt), or (--sdpo-form shaping)
                         token advantages alpha * (log p_hint - log p) at error sites
  DPO on replay pairs    --replay-beta ...: DPO on trace-replay pairs where N external teachers agree

Every weight at zero leaves the plain GRPO loss unchanged. The defaults are zero except where the
student shares the teacher's weights: there --kl-loss-coef 0.1 (k3, both backends) and, on the local
backend, --adv-tau 1 (solver-role GRPO) keep the student role from drifting
(shared_student_objective_defaults).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from slime_meta.errors import UserInputError


@dataclass(frozen=True)
class ObjectivesConfig:
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    aipo_delta: float | None
    eps_clip_c: float | None
    kl_loss_coef: float
    kl_loss_type: str
    use_kl_loss: bool  # slime's switch, accepted on both backends: the term acts whenever kl_loss_coef != 0
    entropy_coef: float
    # context distillation
    teacher_context: str | None
    context_key: str | None
    distill_context: str
    adv_tau: float | None  # None: not given (see solver_adv_tau)
    teacher_tau: float
    student_tau: float
    skip_verification: bool
    eval_baseline: bool
    eval_baseline_problems: int
    eval_baseline_attempts: int
    # JSD self-distillation to the hint-conditioned self (SDPO)
    sdpo_alpha: float
    sdpo_beta: float
    sdpo_temperature: float
    sdpo_topk: int | None  # the teacher as its top-k log-probs (slime: 100 when not given)
    sdpo_topk_tail: bool  # the rest of the teacher's mass as one outcome (True) or the k renormalised (False)
    sdpo_token_clip: float | None
    sdpo_grade_threshold: float
    sdpo_on: str
    sdpo_hint: str | None
    sdpo_form: str  # "jsd" | "shaping"
    # DPO on trace-replay pairs (N external teachers)
    replay_beta: float
    replay_teachers: tuple[str, ...]
    replay_min_agree: int
    replay_dpo_beta: float

    @property
    def distillation_on(self) -> bool:
        return self.teacher_tau != 0.0 or self.student_tau != 0.0

    @property
    def solver_adv_tau(self) -> float:
        """The weight of the solver samples' task advantage (both backends): off unless --adv-tau is given."""
        return 0.0 if self.adv_tau is None else self.adv_tau

    @property
    def solver_grpo_on(self) -> bool:
        """Local backend: --adv-tau alone trains the policy on its own graded solver attempts."""
        return self.solver_adv_tau != 0.0

    @property
    def sdpo_on_any(self) -> bool:
        return self.sdpo_alpha != 0.0

    @property
    def sdpo_shaping(self) -> bool:
        return self.sdpo_on_any and self.sdpo_form == "shaping"

    @property
    def replay_on(self) -> bool:
        return self.replay_beta != 0.0

    @property
    def needs_solver_samples(self) -> bool:
        """Channels that train the policy in its solver role need its own solutions."""
        return self.distillation_on or self.solver_grpo_on or self.sdpo_on_any or self.replay_on

    @property
    def needs_reference(self) -> bool:
        return self.kl_loss_coef != 0.0 or self.replay_on


def add_objective_arguments(add_group) -> None:
    """`add_group(title)` returns an `add(*flags, **kwargs)` that skips flags the parser has."""
    add = add_group("objectives: off-policy correction and regularisers")
    add(
        "--use-tis",
        action="store_true",
        help="Truncated importance sampling: weight each token by clamp(pi_old/pi_rollout).",
    )
    add("--tis-clip", type=float, default=2.0, help="Upper clamp of the TIS weight.")
    add("--tis-clip-low", type=float, default=0.0, help="Lower clamp of the TIS weight.")
    add(
        "--aipo-delta",
        type=float,
        default=None,
        help="AIPO: loss = -min(pi/mu, delta) * A instead of the PPO clip (e.g. 8); default: off.",
    )
    add("--eps-clip-c", type=float, default=None, help="Dual-clip bound (> 1) for negative advantages; default: off.")
    add(
        "--kl-loss-coef",
        type=float,
        default=None,
        help="KL penalty (--kl-loss-type) to a frozen copy of the initial weights. Not given: 0.1 when the student "
        "shares the teacher's weights (no --student-checkpoint, --student-num-gpus or --external-student-url; it "
        "keeps the student role from drifting, docs/performance.md section 6), else 0. Nonzero on --backend slime: "
        "passed with --use-kl-loss, so slime builds its reference model from --ref-load (required then).",
    )
    add(
        "--use-kl-loss",
        action="store_true",
        help="slime's switch for the KL term, accepted on both backends: the term acts whenever --kl-loss-coef is "
        "nonzero (--backend slime passes --use-kl-loss itself then); refused with --kl-loss-coef 0.",
    )
    add(
        "--kl-loss-type",
        choices=("k1", "k2", "k3"),
        default="k3",
        help="KL estimator used as the loss, on both backends (--backend slime passes it: slime's own default is "
        "k1): k3 = exp(ref-logp)-(ref-logp)-1 (low variance; its gradient on "
        "on-policy samples pulls towards the reference); k2 = (logp-ref)^2/2; k1 = logp-ref, whose gradient "
        "is zero in expectation on on-policy samples (docs/objectives.md).",
    )
    add("--entropy-coef", type=float, default=0.0, help="Entropy bonus (subtracted from the loss).")

    add = add_group("objectives: context distillation")
    add(
        "--teacher-context",
        default=None,
        help="Context for the teacher distribution: a text, or @path to read it from a file; default: none.",
    )
    add("--context-key", default=None, help="Dataset column holding a per-row context; default: none.")
    add(
        "--distill-context",
        choices=("none", "additional_info"),
        default="none",
        help="additional_info: the meta-teacher's own final info for that problem is the context.",
    )
    add(
        "--adv-tau",
        type=float,
        default=None,
        help="Weight of the task advantage (GRPO over the m attempts at a problem) in the distillation "
        "advantage of the policy's own solver samples, on both backends; not given = 0 (off: distillation "
        "adds only its log-prob terms; the teacher's infos keep their own GRPO either way). Local backend: "
        "given without --teacher-tau/--student-tau it is a solver-role term of its own (GRPO on the policy's "
        "graded no-info attempts at the train problems; no context needed). Local backend with the "
        "student sharing the teacher's weights: not given = 1, the term that keeps the shared model a good "
        "student (--adv-tau 0 turns it off).",
    )
    add("--teacher-tau", type=float, default=0.0, help="Weight of log p(token | context + prompt).")
    add("--student-tau", type=float, default=0.0, help="Weight of -log p(token | prompt).")
    add("--skip-verification", action="store_true", help="Pure distillation: the solver samples get no task advantage.")
    add("--eval-baseline", action="store_true", help="Before training, grade the student with and without the context.")
    add(
        "--eval-baseline-problems",
        type=int,
        default=64,
        help="--eval-baseline: how many training problems (on slime: at most the first step's).",
    )
    add(
        "--eval-baseline-attempts",
        type=int,
        default=4,
        help="--eval-baseline: attempts at each problem, with and without the context. R_oracle scales every "
        "normalised gain: its standard error (over the problems, reported with it) shrinks with both counts.",
    )

    add = add_group("objectives: JSD self-distillation to the hint-conditioned self (SDPO)")
    add(
        "--sdpo-alpha",
        type=float,
        default=0.0,
        help="Weight of the JSD to the hint-conditioned self (or of the shaping term).",
    )
    add(
        "--sdpo-form",
        choices=("jsd", "shaping"),
        default="jsd",
        help="jsd (default): alpha x JSD(student || hint-conditioned self) per token, over the full vocabulary "
        "or (--sdpo-topk, always on slime) the hint-conditioned self's top-k plus a tail bucket. shaping "
        "(both backends): policy-gradient token advantages alpha x (log p(token | hint prompt) - "
        "log p(token | prompt)) on the error sites' answers, the hint's log-probs from the pool's scoring "
        "call; its own token mean.",
    )
    add("--sdpo-beta", type=float, default=0.5, help="JSD mixture: 0 forward KL(teacher||student), 1 reverse KL.")
    add(
        "--sdpo-temperature",
        type=float,
        default=1.0,
        help="Temperature of both distributions in the hint self-distillation JSD.",
    )
    add(
        "--sdpo-topk",
        type=int,
        default=None,
        help="The hint-conditioned model as its K most likely tokens per response token plus one tail bucket (the "
        "rest of its mass; the policy's mass outside those K ids on the other side): the JSD over K + 1 "
        "outcomes, as the slime backend computes it from the scoring call's top-K log-probs. Local default: "
        "the full vocabulary; slime default: 100.",
    )
    add(
        "--sdpo-topk-tail",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --sdpo-topk: keep the rest of the mass as a tail bucket (default); --no-sdpo-topk-tail "
        "renormalises both sides over the K ids instead (local backend only).",
    )
    add("--sdpo-top-k", type=int, default=None, help=argparse.SUPPRESS)  # the old name: refused with the new one
    add("--sdpo-token-clip", type=float, default=None, help="Cap each token's divergence; default: no cap.")
    add("--sdpo-grade-threshold", type=float, default=1.0, help="Error sites: attempts graded below this.")
    add(
        "--sdpo-on",
        choices=("errors", "all"),
        default="errors",
        help="Which solver attempts get the hint self-distillation term: errors (graded below "
        "--sdpo-grade-threshold) or all.",
    )
    add(
        "--sdpo-hint",
        default=None,
        help="A fixed hint text instead of the meta-teacher's final info; default: none (the info).",
    )

    add = add_group("objectives: DPO on N-teacher trace-replay pairs")
    add("--replay-beta", type=float, default=0.0, help="Weight of the DPO term.")
    add(
        "--replay-teachers", nargs="*", default=[], help="OpenAI-compatible teachers, each name@base_url[#KEY_ENV_VAR]."
    )
    add("--replay-min-agree", type=int, default=2, help="Teachers that must agree on an answer for a pair.")
    add("--replay-dpo-beta", type=float, default=0.1, help="DPO's beta (strength of the implicit KL).")


# Measured on the synthetic task, 400 steps on one H100 (docs/performance.md, section 6): with shared
# weights and the teacher's GRPO alone the student role drifts (gain 0.61 over the last 50 steps,
# no-info control -0.045); a solver-role GRPO term plus k3 KL to the start weights holds it (0.98 and
# 1.03 on two seeds, control within 0.02). Hence these defaults where the student is the trained model.
SHARED_STUDENT_ADV_TAU = 1.0
SHARED_STUDENT_KL_LOSS_COEF = 0.1


def student_shares_weights(ns: argparse.Namespace) -> bool:
    """No separate student: the student pool serves the weights being trained."""
    return not (ns.student_checkpoint or ns.student_num_gpus or getattr(ns, "external_student_url", None))


def shared_student_objective_defaults(ns: argparse.Namespace) -> dict:
    """--adv-tau and --kl-loss-coef as resolved: the shared-student defaults where they apply. The KL
    term applies on both backends (slime builds its reference model for it); the solver-role GRPO
    term (--adv-tau alone) runs on both, but its default is local: on slime its solver samples need
    --rollout-temperature = --teacher-temperature (slime's trainer scores every sample at one), which
    the default temperatures are not."""
    shared = student_shares_weights(ns)
    adv_tau, kl_loss_coef = ns.adv_tau, ns.kl_loss_coef
    if shared and ns.backend == "local" and adv_tau is None:
        adv_tau = SHARED_STUDENT_ADV_TAU
    if kl_loss_coef is None:
        kl_loss_coef = SHARED_STUDENT_KL_LOSS_COEF if shared else 0.0
    if getattr(ns, "use_kl_loss", False) and kl_loss_coef == 0.0:
        raise UserInputError(
            "--use-kl-loss with --kl-loss-coef 0: the KL term would weigh nothing; give --kl-loss-coef X (e.g. 0.1), "
            "or leave --use-kl-loss out"
        )
    return {"adv_tau": adv_tau, "kl_loss_coef": kl_loss_coef}


def read_context(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:])
    if not path.is_file():
        raise UserInputError(f"--teacher-context {value}: no such file; give @path to a text file or the text itself")
    return path.read_text(encoding="utf-8")


def validate_objective_flags(ns: argparse.Namespace) -> None:
    def fail(message: str) -> None:
        raise UserInputError(message)

    if ns.use_tis and not ns.tis_clip > ns.tis_clip_low >= 0:
        fail(f"--tis-clip {ns.tis_clip} / --tis-clip-low {ns.tis_clip_low}: need tis_clip > tis_clip_low >= 0")
    if ns.aipo_delta is not None and (ns.aipo_delta <= 0 or ns.use_tis or ns.eps_clip_c):
        fail("--aipo-delta: must be > 0 and replaces --use-tis and --eps-clip-c; give one form of correction")
    if ns.eps_clip_c is not None and ns.eps_clip_c <= 1.0:
        fail(f"--eps-clip-c {ns.eps_clip_c}: the dual-clip bound must be > 1 (e.g. 3)")
    distill = ns.teacher_tau != 0.0 or ns.student_tau != 0.0
    sources = [s for s in (ns.teacher_context, ns.context_key) if s] + (
        ["info"] if ns.distill_context != "none" else []
    )
    if distill and not sources:
        fail(
            "--teacher-tau/--student-tau need a context: --teacher-context, --context-key or --distill-context "
            "additional_info"
        )
    if len(sources) > 1:
        fail("give one context source: --teacher-context, --context-key or --distill-context additional_info")
    if ns.sdpo_top_k is not None:
        fail(
            f"--sdpo-top-k {ns.sdpo_top_k}: renamed; give --sdpo-topk {ns.sdpo_top_k} --no-sdpo-topk-tail for the "
            f"top-k renormalised as before, or --sdpo-topk {ns.sdpo_top_k} alone to keep the rest as a tail bucket"
        )
    if ns.sdpo_topk is not None and ns.sdpo_topk < 1:
        fail(f"--sdpo-topk {ns.sdpo_topk}: must be >= 1 (e.g. 100)")
    if not ns.sdpo_topk_tail and ns.sdpo_topk is None:
        fail("--no-sdpo-topk-tail without --sdpo-topk: give --sdpo-topk K (the number of ids to renormalise over)")
    if not 0.0 <= ns.sdpo_beta <= 1.0:
        fail(f"--sdpo-beta {ns.sdpo_beta}: must be in [0, 1]")
    if ns.replay_beta != 0.0 and len(ns.replay_teachers) < max(ns.replay_min_agree, 1):
        fail(
            f"--replay-beta needs at least --replay-min-agree ({ns.replay_min_agree}) --replay-teachers (name@base_url)"
        )
    if ns.replay_min_agree < 1:
        fail(f"--replay-min-agree {ns.replay_min_agree}: must be >= 1")
