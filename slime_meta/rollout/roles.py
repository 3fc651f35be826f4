"""The three roles over their pools: student, grader and teacher.

Each role turns domain values (problems, attempts, infos) into prompts through its template and
into requests to its pool. The teacher's prompt is tokenised here and sent as `input_ids`, so the
trainer later trains on exactly the ids the engine saw and sampled.

With its model's `context_length` known, a role never sends a request that cannot fit: the
teacher's attempts are shortened to the budget, a student request's `max_new_tokens` is clamped
to what its prompt leaves (slime_meta/rollout/context_budget.py).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from slime_meta.errors import UserInputError
from slime_meta.prompt_templates import GeneratorPromptTemplate, Message, TeacherPromptTemplate, attempts_in_round
from slime_meta.rollout.context_budget import (
    ContextBudgetStats,
    TokenCounter,
    fit_teacher_prompt,
    longest_prompt,
    student_new_tokens,
)
from slime_meta.rollout.pools import SGLangPool
from slime_meta.types import Completion, Grade, GradedAttempt, Problem


class Grader(Protocol):
    async def grade(self, problem: Problem, solution: str) -> Grade: ...


def resolve_chat_template(tokenizer: Any | None, apply_chat_template: bool | None) -> bool:
    """Whether prompts for this tokenizer's model are rendered with its chat template.

    None (the default, `--apply-chat-template` not given) means: when the tokenizer has one. An
    instruct model prompted without its template mostly answers nothing (it emits its end-of-turn
    token at once), while a base model or the project's tiny models have no template and keep the
    plain format. `--apply-chat-template` with a tokenizer that has no template is refused.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template is None:
        return has_template
    if apply_chat_template and not has_template:
        raise UserInputError(
            f"--apply-chat-template: the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!s} has no chat "
            "template; leave the flag out (plain prompts) or use a checkpoint whose tokenizer_config.json has one"
        )
    return bool(apply_chat_template)


def chat_setting(apply_chat_template: bool | None, *templates: Any) -> bool | None:
    """The run's chat-template setting for roles using `templates`: a completion-format template
    (`chat_format = False`, the synthetic tasks') keeps plain text unless the flag forces the template."""
    if apply_chat_template is None and any(getattr(t, "chat_format", None) is False for t in templates):
        return False
    return apply_chat_template


class PromptRenderer:
    """Messages -> prompt text (and ids): the model's own chat template, or the contents joined.

    Each role renders with its own model's tokenizer, so a student of another family than the
    teacher gets its own chat format. `apply_chat_template` None: the template when there is one.
    """

    def __init__(self, tokenizer: Any | None, apply_chat_template: bool | None):
        self.tokenizer = tokenizer
        apply_chat_template = resolve_chat_template(tokenizer, apply_chat_template)
        self.apply_chat_template = apply_chat_template
        self._encode = self._fast_encoder(tokenizer, add_special_tokens=not apply_chat_template)

    @staticmethod
    def _fast_encoder(tokenizer: Any | None, add_special_tokens: bool) -> Any | None:
        """The Rust tokenizer's own `encode`, when it gives the same ids as the HF wrapper.

        Why: the wrapper's per-call Python work is about a third of the teacher request's client
        CPU, and the inner loop sends thousands of requests per step from one thread. The check on
        a probe text guards against wrappers that post-process ids in Python.
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        probe = "Problem 1: 12 + 30 = ?\n\nAnswer: 42. {braces} «unicode» \t end"
        try:
            same = backend.encode(probe, add_special_tokens=add_special_tokens).ids == list(
                tokenizer(probe, add_special_tokens=add_special_tokens)["input_ids"]
            )
        except Exception:  # any wrapper quirk: keep the wrapper
            return None
        return backend.encode if same else None

    @functools.cached_property
    def text_is_exact(self) -> bool:
        """Whether a server that tokenises this renderer's text itself gets the renderer's ids.

        An SGLang server encodes a text prompt with the tokenizer's special tokens added; a chat
        template that writes the BOS token itself (Llama 3's) then gets a second one. Where that
        happens (or the tokenizer is unknown here), requests carry the ids instead of the text.
        """
        if self.tokenizer is None:
            return True
        probe = self.text([{"role": "user", "content": "Problem: 2 + 2 = ?"}])
        try:
            served = list(self.tokenizer(probe)["input_ids"])
        except Exception:  # a tokenizer without the call form: send ids, which are always exact
            return False
        return served == self.ids_of_text(probe)

    def text(self, messages: Sequence[Message]) -> str:
        if self.apply_chat_template:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return "\n\n".join(m["content"] for m in messages)

    def ids(self, messages: Sequence[Message]) -> list[int]:
        return self.ids_of_text(self.text(messages))

    def ids_of_text(self, text: str) -> list[int]:
        # A rendered chat template already holds its special tokens; plain text gets the
        # tokenizer's own (BOS for Llama-style tokenizers, none for Qwen-style ones).
        if self._encode is not None:
            return self._encode(text, add_special_tokens=not self.apply_chat_template).ids
        return list(self.tokenizer(text, add_special_tokens=not self.apply_chat_template)["input_ids"])


@dataclass
class StudentRole:
    pool: SGLangPool
    template: GeneratorPromptTemplate
    renderer: PromptRenderer
    info_position: str
    temperature: float
    max_new_tokens: int
    context_length: int | None = None  # the student model's; None: requests are not clamped
    budget_stats: ContextBudgetStats = field(default_factory=ContextBudgetStats)

    def prompt(self, problem: Problem, info: str) -> str:
        return self.renderer.text(self.template.build(problem, info, self.info_position))

    def prompt_ids(self, problem: Problem, info: str) -> list[int]:
        return self.renderer.ids(self.template.build(problem, info, self.info_position))

    async def solve(self, problem: Problem, info: str, *, with_tokens: bool = False) -> tuple[str, Completion]:
        """One solution of `problem` given the teacher's info: (prompt text, completion).

        `with_tokens`: send the prompt as ids and ask for log-probs, so the solution can be trained
        on as the policy's own sample (solver-role channels); otherwise plain text is enough.
        """
        prompt, completions = await self.solve_n(problem, info, 1, with_tokens=with_tokens)
        return prompt, completions[0]

    async def solve_n(
        self, problem: Problem, info: str, n: int, *, with_tokens: bool = False
    ) -> tuple[str, list[Completion]]:
        """`n` independent solutions of `problem` given the info, as ONE request with
        `sampling_params.n = n`: the server prefills the prompt once for all n (SGLang's parallel
        sampling), and the pool sees n times fewer requests. Budget counters count solutions."""
        prompt = self.prompt(problem, info)
        # Counted in the student model's own tokenizer: the renderer is the student's.
        max_new_tokens, prompt_tokens = student_new_tokens(
            prompt, self.max_new_tokens, self.context_length, lambda text: len(self.renderer.ids_of_text(text))
        )
        self.budget_stats.student_requests += n
        if max_new_tokens < 1:  # the prompt alone fills the context: empty answers, not a refused request
            self.budget_stats.student_requests_skipped += n
            ids = tuple(self.renderer.ids_of_text(prompt)) if with_tokens else ()
            return prompt, [Completion(text="", prompt_ids=ids, finish_reason="length") for _ in range(n)]
        if max_new_tokens < self.max_new_tokens:
            self.budget_stats.student_requests_clamped += n
        sampling = {"temperature": self.temperature, "max_new_tokens": max_new_tokens}
        if with_tokens:
            ids = self.renderer.ids_of_text(prompt)
            return prompt, await self.pool.generate_n(input_ids=ids, sampling_params=sampling, return_logprob=True, n=n)
        if not self.renderer.text_is_exact:
            ids = self.renderer.ids_of_text(prompt)
            return prompt, await self.pool.generate_n(input_ids=ids, sampling_params=sampling, n=n)
        return prompt, await self.pool.generate_n(text=prompt, sampling_params=sampling, n=n)

    def fits_scoring(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> bool:
        """Whether a scoring call of `response_ids` after `prompt_ids` fits the model: SGLang refuses
        an input of the context length or more, even with max_new_tokens 0."""
        return self.context_length is None or len(prompt_ids) + len(response_ids) < self.context_length

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        """log p(response | prompt) per response token, by SGLang's scoring call (no generation)."""
        reply = await self.pool.post(
            "/generate",
            {
                "input_ids": list(prompt_ids) + list(response_ids),
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        )
        entries = reply["meta_info"]["input_token_logprobs"]
        return [float(e[0]) for e in entries[len(entries) - len(response_ids) :]]

    async def score_topk(self, prompt_ids: Sequence[int], response_ids: Sequence[int], k: int) -> tuple[Any, Any]:
        """The `k` most likely tokens (temperature 1) at each response token given the prompt, by
        SGLang's scoring call with `top_logprobs_num` (no generation): `[R, k]` ids (int32) and
        log-probs (float32), 8 * k bytes per token. `meta_info.input_top_logprobs` holds one list of
        [logprob, id, text] per input position from `logprob_start_len` on."""
        reply = await self.pool.post(
            "/generate",
            {
                "input_ids": list(prompt_ids) + list(response_ids),
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": len(prompt_ids),
                "top_logprobs_num": int(k),
            },
        )
        tops = (reply["meta_info"].get("input_top_logprobs") or [])[-len(response_ids) :]
        if len(tops) != len(response_ids) or any(top is None or len(top) != k for top in tops):
            raise ValueError(
                f"the scoring call returned {len(tops)} top-{k} lists for {len(response_ids)} response "
                "tokens: the server does not return input_top_logprobs as SGLang does"
            )
        ids_R_K = np.array([[int(entry[1]) for entry in top] for top in tops], dtype=np.int32)
        logprobs_R_K = np.array([[float(entry[0]) for entry in top] for top in tops], dtype=np.float32)
        return ids_R_K, logprobs_R_K


@dataclass
class TeacherRole:
    pool: SGLangPool
    template: TeacherPromptTemplate
    renderer: PromptRenderer
    temperature: float
    max_new_tokens: int
    context_length: int | None = None  # the teacher model's; None: the prompt is not fitted
    budget_stats: ContextBudgetStats = field(default_factory=ContextBudgetStats)

    def __post_init__(self):
        self._counter = TokenCounter(self.renderer.tokenizer) if self.context_length is not None else None
        # A template whose build() takes no `round_infos` has a format made for one round (the
        # synthetic tasks' teachers were trained on it): it is given the current round only.
        self._reads_rounds = "round_infos" in inspect.signature(self.template.build).parameters

    def prompt_and_ids(
        self,
        problems: Sequence[Problem],
        attempts_K_M: Sequence[Sequence[GradedAttempt]],
        previous_info: str,
        round_infos: Sequence[str] = (),
    ) -> tuple[str, list[int]]:
        """The teacher's prompt and its ids, shortened to leave `max_new_tokens` of the context.

        `round_infos`: the info of each inner round so far, when `attempts_K_M` holds every round's
        attempts (the teacher's history); the budget drops the oldest round's attempts first.
        """
        if round_infos and not self._reads_rounds:
            attempts_K_M = attempts_in_round(attempts_K_M, len(round_infos) - 1)
            round_infos = ()
        rounds = {"round_infos": tuple(round_infos)} if round_infos else {}

        def build(problems_K, attempts, info) -> tuple[str, list[int]]:
            text = self.renderer.text(self.template.build(problems_K, attempts, info, **rounds))
            return text, self.renderer.ids_of_text(text)

        if self._counter is None:
            return build(problems, attempts_K_M, previous_info)
        # Strictly inside the context: SGLang refuses a prompt + max_new_tokens that fills it.
        budget = longest_prompt(self.context_length, self.max_new_tokens)
        return fit_teacher_prompt(
            build, problems, attempts_K_M, previous_info, budget, self._counter, self.budget_stats
        )

    async def write_info(
        self,
        problems: Sequence[Problem],
        attempts_K_M: Sequence[Sequence[GradedAttempt]],
        previous_info: str,
        round_infos: Sequence[str] = (),
    ) -> tuple[str, Completion, str]:
        """The teacher's next info: (info, the sampled completion, the prompt text)."""
        prompt, ids = self.prompt_and_ids(problems, attempts_K_M, previous_info, round_infos)
        completion = await self.pool.generate(
            input_ids=ids,
            sampling_params={"temperature": self.temperature, "max_new_tokens": self.max_new_tokens},
            return_logprob=True,
        )
        return self.template.parse_info(completion.text), completion, prompt
