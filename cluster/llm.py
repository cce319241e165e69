"""vLLM-compatible offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pagedserve.cluster.beam_search import BeamSearchOutput, BeamSearchParams, beam_sequences
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.engine import LLMEngine
from pagedserve.cluster.late_interaction import late_interaction, pair_score
from pagedserve.cluster.multimodal import split_chat_images
from pagedserve.cluster.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.cluster.processor_options import MediaList
from pagedserve.cluster.prompt_embeds import EmbedsPrompt
from pagedserve.cluster.text_pairs import pair_texts, pair_token_ids
from pagedserve.cluster.video import VideoSource
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

# vLLM's prompt forms: text, token ids, or a TextPrompt / TokensPrompt dict.
PromptType = str | list[int] | Mapping[str, Any]


# A prompt as the engine takes it: text, token ids or embeddings, and its images (None:
# none).
Prompt = tuple[str | list[int] | EmbedsPrompt, list[Any] | None]


def _unwrap(prompt: PromptType) -> Prompt:
    """Text, token ids or embeddings, and images, from any of vLLM's prompt forms (a
    dict's ``multi_modal_data`` holds ``{"image": one or a list}``, its
    ``mm_processor_kwargs`` the processor's options for this prompt's images: a
    ``MediaList``; an ``EmbedsPrompt`` dict's ``prompt_embeds`` a ``[tokens, hidden]``
    tensor)."""
    if isinstance(prompt, Mapping):
        if "prompt_embeds" in prompt:
            return EmbedsPrompt(prompt["prompt_embeds"]), _images(prompt.get("multi_modal_data"))
        images = _images(prompt.get("multi_modal_data"))
        options = prompt.get("mm_processor_kwargs")
        if images and options:
            images = MediaList(images, options)
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), images
        if "prompt" in prompt:
            return prompt["prompt"], images
        raise ValueError("prompts: a dict prompt needs 'prompt', 'prompt_token_ids' or "
                         "'prompt_embeds', "
                         f"got keys {sorted(prompt)}")
    return prompt, None


def _images(data: Any) -> list[Any] | None:
    """A prompt's ``multi_modal_data`` as one media list: its images, then its videos
    (each kind fills its own placeholders in order). A video is a URL, bytes, a
    ``VideoClip``, PIL frames or a uint8 ``[T, H, W, 3]`` array; a list of such is
    several, except a list of PIL images, which is one video's frames."""
    if data is None:
        return None
    if not isinstance(data, Mapping) or set(data) - {"image", "video"}:
        raise ValueError("multi_modal_data: only {'image': an image or a list, 'video': a "
                         "video or a list} is taken, got "
                         f"{data if not isinstance(data, Mapping) else sorted(data)!r}")
    images = data.get("image")
    images = [] if images is None else \
        list(images) if isinstance(images, (list, tuple)) else [images]
    videos = data.get("video")
    if videos is not None:
        from PIL import Image

        one = not isinstance(videos, (list, tuple)) or \
            (bool(videos) and all(isinstance(v, Image.Image) for v in videos))
        images += [VideoSource(v) for v in ([videos] if one else videos)]
    return images or None


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[Prompt]:
    """One prompt or a batch, in any of vLLM's forms, as text or token ids with images."""
    if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    return [_unwrap(p) for p in prompts]  # type: ignore[union-attr]


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt from one for all or a list of ``n``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
    return loras


class LLM:
    """Batch generation with the full engine (paged KV, continuous batching).

    Keyword arguments are :class:`EngineConfig` fields, e.g.
    ``LLM(model=path, tensor_parallel_size=2, num_gpu_blocks=64)``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.llm_engine = self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        ``lora_request`` runs every prompt with one LoRA adapter, or (a list) each
        prompt with its own (None: the base model); prompts of different adapters
        share the batch. ``priority`` (one per prompt, lower first) needs
        ``scheduling_policy="priority"``.

        A bad prompt or setting anywhere in the batch raises before anything runs,
        and the batch's requests added before it are withdrawn: none of them is
        left queued to run (and hold blocks) during a later call.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts"
                )
        loras = _per_prompt(lora_request, len(prompts))
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority: got {len(prios)} for {len(prompts)} prompts")
        ids = self._add_all([(p, dict(params=sp, lora_request=lora, priority=prio))
                             for p, sp, lora, prio in zip(prompts, params, loras, prios)])
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 16)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with ``chat_template_kwargs`` as extra
        template variables, e.g. Qwen3's ``enable_thinking``; ``continue_final_message``
        leaves the last message open, so the model goes on with it: set
        ``add_generation_prompt=False`` with it, as in vLLM), then generate. Messages
        may hold OpenAI's image parts (``image_url``: a data URL, an http(s) URL, a
        local file under ``allowed_local_media_path``) for a multimodal model,
        processed under ``mm_processor_kwargs`` over the engine's (vLLM's)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        extra = dict(chat_template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        prompts: list[PromptType] = []
        for conv in conversations:
            rendered, images = split_chat_images(conv)
            if not images:
                prompts.append(list(tok.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                    return_dict=False, **extra)))
                continue
            if self.engine.images is None:
                raise ValueError("messages: this model takes no images")
            ids, images = self.engine.images.chat_prompt(rendered, images,
                                                         add_generation_prompt,
                                                         mm_processor_kwargs, **extra)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images},
                            "mm_processor_kwargs": mm_processor_kwargs})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` hypotheses per
        prompt, each with its tokens (prompt included), text and cumulative logprob.

        Each prompt is one request whose beams fork on each other's KV blocks in
        the scheduler (``scheduler/beam.py``): a step computes one token per live
        beam, and the beams of all prompts share each batch.
        """
        ids = self._add_all([(p, dict(beam=params, lora_request=lora_request))
                             for p in _prompt_list(prompts)])
        decode = self.engine.tokenizer.decode
        return [BeamSearchOutput(beam_sequences(out, decode))
                for out in self._run(ids, use_tqdm=False, desc="beam search")]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): the model's final hidden
        states pooled as ``pooling_params`` says (default: last token, L2-normalised).

        Embedding requests share batches, the prefix cache and chunked prefill with
        generation; any supported model embeds (its last norm's output).
        """
        outs = self._pool(_prompt_list(prompts), pooling_params or PoolingParams(), use_tqdm,
                          lora_request, truncate_prompt_tokens, "embed")
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(o.embedding or []), o.finished)
                for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_activation: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities from a sequence classifier (vLLM's
        ``LLM.classify``): its ``score`` head over the last token's final state, then
        softmax (sigmoid for one label or a multi-label file, none for regression);
        ``use_activation=False`` gives the raw logits; ``pooling_params`` may pool the
        mean state instead. Labels: ``id2label``, in
        ``llm.engine.model_info["classifier"]["labels"]``."""
        pooling = dataclasses.replace(pooling_params or PoolingParams(), task="classify",
                                      use_activation=use_activation)
        outs = self._pool(_prompt_list(prompts), pooling, use_tqdm, lora_request,
                          truncate_prompt_tokens, "classify")
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.embedding or []), o.finished)
                for o in outs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled result as a tensor. The token
        tasks give a row per prompt token: "token_embed" each token's final state (L2-
        normalised unless ``pooling_params`` says not), "token_classify" each token's
        label probabilities (a ``...ForTokenClassification`` encoder, or a decoder
        sequence classifier's head on every prefix). ``pooling_task`` None: the
        model's own token task; "embed" / "classify" / "score" give one vector."""
        if pooling_task is None:
            classifier = self.engine.model_info.get("classifier")
            pooling_task = "token_embed" if classifier is None else "token_classify"
        pooling = dataclasses.replace(pooling_params or PoolingParams(), task=pooling_task)
        outs = self._pool(_prompt_list(prompts), pooling, use_tqdm, lora_request,
                          truncate_prompt_tokens, pooling_task)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids,
                                     PoolingOutput(torch.tensor(o.embedding or [])),
                                     o.finished)
                for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: ``data_1`` against each of ``data_2`` (or two lists
        pairwise). A one-label sequence classifier (a cross-encoder reranker) reads each
        pair as one prompt (``text_pairs.pair_token_ids``) and scores it through its
        activation; an embedding model scores the cosine similarity of the two texts'
        embeddings, each distinct text embedded once; a ColBERT model their late
        interaction (MaxSim over their token vectors, ``late_interaction``)."""
        firsts, seconds = pair_texts(data_1, data_2, ("data_1", "data_2"))
        classifier = self.engine.model_info.get("classifier")
        if classifier is not None:
            tok = self.engine.tokenizer
            ids = [pair_token_ids(tok, a, b, truncate_prompt_tokens,
                                  classifier["pair_encoding"],
                                  bool(self.engine.model_info.get("encoder")))
                   for a, b in zip(firsts, seconds, strict=True)]
            outs = self._pool([(i, None) for i in ids], PoolingParams(task="score"),
                              use_tqdm, lora_request, None, "score")
            return [ScoringRequestOutput(f"score-{i}", o.prompt_token_ids,
                                         ScoringOutput((o.embedding or [0.0])[0]))
                    for i, o in enumerate(outs)]
        texts = list(dict.fromkeys(firsts + seconds))
        late = late_interaction(self.engine.model_info)
        kw: dict[str, Any] = dict(use_tqdm=use_tqdm, lora_request=lora_request,
                                  truncate_prompt_tokens=truncate_prompt_tokens)
        outs = self.encode(texts, pooling_task="token_embed", **kw) if late else \
            self.embed(texts, **kw)
        ids = {t: o.prompt_token_ids for t, o in zip(texts, outs, strict=True)}
        vecs = {t: o.outputs.data if late else o.outputs.embedding
                for t, o in zip(texts, outs, strict=True)}
        return [ScoringRequestOutput(f"score-{i}", ids[a] + ids[b],
                                     ScoringOutput(pair_score(vecs[a], vecs[b])))
                for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))]

    def _pool(self, prompts: list[Prompt], pooling: PoolingParams, use_tqdm: bool | None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
              truncate_prompt_tokens: int | None, desc: str) -> list[RequestOutput]:
        """Run pooling requests to the end (a bar from 16 prompts unless told)."""
        sp = SamplingParams(max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)
        loras = _per_prompt(lora_request, len(prompts))
        ids = self._add_all([(p, dict(params=sp, lora_request=lora, pooling_params=pooling))
                             for p, lora in zip(prompts, loras)])
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 16, desc)

    def _add_all(self, requests: list[tuple[Prompt, dict[str, Any]]]) -> list[str]:
        """Queue every request; if one is refused, withdraw those already queued (none
        is left to run, and hold blocks, during a later call) and raise."""
        ids: list[str] = []
        try:
            for (prompt, images), kwargs in requests:  # ``_run`` reads finished outputs only
                ids.append(self.engine.add_request(prompt, **kwargs, output_kind="final_only",
                                                   images=images))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "generate"
             ) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc=desc, unit="req")
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: free the KV cache (level 2: the weights too) until
        ``wake_up``, e.g. while a trainer uses the device. Between batches only."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def update_weights(self, model: str) -> None:
        """Generate with another checkpoint of the same architecture from now on (an RLHF
        step's weights, as SGLang's ``update_weights_from_disk``); asleep or awake."""
        self.engine.update_weights(model)

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
