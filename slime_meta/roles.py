"""The three roles over their pools: student (generator), grader and teacher.

Each role turns domain values (problems, attempts, infos) into prompts through its template and
into requests to its pool. The teacher's prompt is tokenised here and sent as `input_ids`, so the
trainer later trains on exactly the ids the engine saw and sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from slime_meta.pools import SGLangPool
from slime_meta.prompt_templates import GeneratorPromptTemplate, Message, TeacherPromptTemplate
from slime_meta.types import Completion, Grade, GradedAttempt, Problem


class Grader(Protocol):
    async def grade(self, problem: Problem, solution: str) -> Grade: ...


class PromptRenderer:
    """Messages -> prompt text (and ids): the chat template, or the contents joined."""

    def __init__(self, tokenizer: Any | None, apply_chat_template: bool):
        self.tokenizer = tokenizer
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

    def prompt(self, problem: Problem, info: str) -> str:
        return self.renderer.text(self.template.build(problem, info, self.info_position))

    def prompt_ids(self, problem: Problem, info: str) -> list[int]:
        return self.renderer.ids(self.template.build(problem, info, self.info_position))

    async def solve(self, problem: Problem, info: str, *, with_tokens: bool = False) -> tuple[str, Completion]:
        """One solution of `problem` given the teacher's info: (prompt text, completion).

        `with_tokens`: send the prompt as ids and ask for log-probs, so the solution can be trained
        on as the policy's own sample (solver-role channels); otherwise plain text is enough.
        """
        prompt = self.prompt(problem, info)
        sampling = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}
        if with_tokens:
            ids = self.renderer.ids_of_text(prompt)
            return prompt, await self.pool.generate(input_ids=ids, sampling_params=sampling, return_logprob=True)
        return prompt, await self.pool.generate(text=prompt, sampling_params=sampling)

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        """log p(response | prompt) per response token, by SGLang's scoring call (no generation)."""
        reply = await self.pool.post(
            "/generate",
            {"input_ids": list(prompt_ids) + list(response_ids), "sampling_params": {"max_new_tokens": 0},
             "return_logprob": True, "logprob_start_len": 0},
        )  # fmt: skip
        entries = reply["meta_info"]["input_token_logprobs"]
        return [float(e[0]) for e in entries[len(entries) - len(response_ids) :]]


@dataclass
class TeacherRole:
    pool: SGLangPool
    template: TeacherPromptTemplate
    renderer: PromptRenderer
    temperature: float
    max_new_tokens: int

    async def write_info(
        self, problems: Sequence[Problem], attempts_K_M: Sequence[Sequence[GradedAttempt]], previous_info: str
    ) -> tuple[str, Completion, str]:
        """The teacher's next info: (info, the sampled completion, the prompt text)."""
        prompt = self.renderer.text(self.template.build(problems, attempts_K_M, previous_info))
        completion = await self.pool.generate(
            input_ids=self.renderer.ids_of_text(prompt),
            sampling_params={"temperature": self.temperature, "max_new_tokens": self.max_new_tokens},
            return_logprob=True,
        )
        return self.template.parse_info(completion.text), completion, prompt
