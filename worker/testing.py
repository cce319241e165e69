"""Random Llama-family checkpoints with a made-up tokenizer, for tests and benchmarks.

They go through the real loaders like any Hugging Face directory. Their point
is machines where the default model is not installed (the GPU box gets no
package index and its 98 MB GGUF does not travel there): shapes, kernels and
speed do not depend on the weights' values. Needs ``transformers``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from pagedserve.worker.testing_shapes import (  # (and re-exported: tests import them here)
    GRANITE_SCALES,
    MOE_DEFAULTS,
    QWEN3_5_VISION,
    ZERO_CENTERED_NORMS,
)
from pagedserve.worker.testing_shapes import (
    SMOLLM2_135M as SMOLLM2_135M,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def write_wordlevel_tokenizer(dest: str | Path, vocab_size: int,
                              words: tuple[str, ...] = (), specials: tuple[str, ...] = (),
                              chat_template: str | None = None) -> None:
    """A real tokenizer made on the spot: word ``t<i>`` is token ``i`` (``t2`` is EOS),
    the last ``len(words)`` ids spelt ``words`` instead, ``specials`` among them split out
    wherever they stand (an image token run needs no spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spelt = [f"t{i}" for i in range(vocab_size)]
    spelt[vocab_size - len(words):] = words
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(spelt)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2", pad_token="t0")
    if specials:
        fast.add_special_tokens({"additional_special_tokens": list(specials)})
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(dest))


def write_random_checkpoint(dest: str | Path, kind: str = "llama",
                            tokenizer_dir: str | Path | None = None, seed: int = 1234,
                            weight_scale: float = 4.0, base_model: bool = False,
                            classifier: bool = False, **overrides: Any) -> str:
    """Save a random ``kind`` model to ``dest``; return its path.

    ``kind``: "llama", "mistral", "qwen2", "qwen3", or the mixtures of experts "mixtral",
    "qwen2_moe", "qwen3_moe" (4 experts, top 2, 32 wide unless overridden) and
    "deepseek_v2", "deepseek_v3" (MLA, 8 experts in 4 groups: ``MOE_DEFAULTS``), and
    "gpt_oss" (4 experts, attention sinks, alternating 12-token windows), and Granite's
    "granite", "granitemoe", "granitemoeshared" (``GRANITE_SCALES``), and Granite 4.0-H's
    "granitemoehybrid" (Mamba-2 and attention layers), "nemotron_h" (Mamba-2,
    attention and MLP blocks), "qwen3_next" (gated DeltaNet and gated attention), and
    Qwen3.5's multimodal "qwen3_5" / "qwen3_5_moe" (the same decoder beside a vision
    encoder), and "lfm2" (gated short convolutions and attention), and "falcon_h1" (a
    Mamba-2 mixer beside each attention, muP multipliers), and "jamba" (Mamba-1 and
    attention layers, experts every other layer), and the attention-free "mamba",
    "falcon_mamba" (Mamba-1 blocks) and "mamba2" (Mamba-2 blocks).

    ``base_model`` saves the bare decoder (``LlamaModel``...: no ``model.`` prefix, no
    LM head), as embedding checkpoints are; ``classifier`` the sequence classifier
    (``LlamaForSequenceClassification``...: a ``score`` head of ``num_labels`` rows, set
    by ``num_labels`` / ``id2label`` / ``problem_type`` overrides).

    The defaults are a 2-layer, 64-wide model; ``overrides`` are config fields.
    Matrices are scaled by ``weight_scale`` so logits are sharper than the
    default init's, leaving fewer argmax near-ties between implementations.
    The tokenizer is copied from ``tokenizer_dir``, or made up when None.
    """
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, tf.LlamaModel),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM, tf.MistralModel),
               "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, tf.Gemma3TextModel),
               "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, tf.Phi3Model),
               "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, tf.Gemma2Model),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, tf.Qwen2Model),
               "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, tf.Qwen3Model),
               "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, tf.MixtralModel),
               "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, tf.Qwen2MoeModel),
               "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, tf.Qwen3MoeModel),
               "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM,
                               tf.DeepseekV2Model),
               "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                               tf.DeepseekV3Model),
               "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, tf.GptOssModel),
               "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, tf.GraniteModel),
               "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, tf.Olmo2Model),
               "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, tf.SmolLM3Model),
               "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, tf.Glm4MoeModel),
               "ernie4_5": (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM, tf.Ernie4_5Model),
               "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM, tf.Glm4Model),
               "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM,
                                tf.Ernie4_5_MoeModel),
               "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM, tf.Olmo3Model),
               "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM,
                              tf.GraniteMoeModel),
               "granitemoeshared": (tf.GraniteMoeSharedConfig, tf.GraniteMoeSharedForCausalLM,
                                    tf.GraniteMoeSharedModel),
               "granitemoehybrid": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM,
                                    tf.GraniteMoeHybridModel),
               "nemotron_h": (tf.NemotronHConfig, tf.NemotronHForCausalLM, tf.NemotronHModel),
               "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, tf.Qwen3NextModel),
               "qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration,
                           tf.Qwen3_5Model),
               "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration,
                               tf.Qwen3_5MoeModel),
               "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM, tf.Lfm2Model),
               "lfm2_moe": (tf.Lfm2MoeConfig, tf.Lfm2MoeForCausalLM, tf.Lfm2MoeModel),
               "bamba": (tf.BambaConfig, tf.BambaForCausalLM, tf.BambaModel),
               "falcon_h1": (tf.FalconH1Config, tf.FalconH1ForCausalLM, tf.FalconH1Model),
               "jamba": (tf.JambaConfig, tf.JambaForCausalLM, tf.JambaModel),
               "mamba": (tf.MambaConfig, tf.MambaForCausalLM, tf.MambaModel),
               "falcon_mamba": (tf.FalconMambaConfig, tf.FalconMambaForCausalLM,
                                tf.FalconMambaModel),
               "mamba2": (tf.Mamba2Config, tf.Mamba2ForCausalLM, tf.Mamba2Model)}
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    config_cls, causal_cls, bare_cls = classes[kind]
    model_cls = bare_cls if base_model else causal_cls
    if classifier:
        model_cls = getattr(tf, causal_cls.__name__.replace("ForCausalLM",
                                                            "ForSequenceClassification"))
    cfg: dict[str, Any] = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=512,
                               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg.update(MOE_DEFAULTS.get(kind, {}))
    if kind.startswith("granite"):
        cfg.update(GRANITE_SCALES)
    if kind in ("smollm3", "glm4"):  # (their configs' default pad ids are past our vocab)
        cfg["pad_token_id"] = 0
    cfg.update(overrides)
    torch.manual_seed(seed)
    if kind in ("qwen3_5", "qwen3_5_moe"):  # (a small vision encoder beside the decoder)
        config = config_cls(text_config=cfg, vision_config=QWEN3_5_VISION)
    else:
        config = config_cls(**cfg)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # (experts are stacked 3-D in memory)
                p.mul_(weight_scale)
            elif kind.startswith("gemma") or kind in ZERO_CENTERED_NORMS:  # (1 + w: init 0)
                p.normal_(0.0, 0.5)
        for name, p in model.named_parameters():  # GPT-OSS: sinks and biases that matter
            if kind == "gpt_oss" and (name.endswith("sinks") or "bias" in name):
                p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.2)
            if name.endswith((".mamba.D", ".mamba.dt_bias", ".mixer.D", ".mixer.dt_bias",
                              ".mamba.dt_proj.bias", ".mixer.dt_proj.bias")):
                # (Mamba's init: all ones)
                p.normal_(1.0 if name.endswith("D") else 0.0, 0.5)
            if name.endswith((".mamba.A_log", ".mixer.A_log")) and p.dim() == 2:
                # (Mamba-1's per-channel decays, scaled with the matrices above: back
                # to rates between 0.1 and 3, so a state remembers a few tokens)
                p.uniform_(-2.0, 1.0)
            if ".mamba." in name and name.endswith("_layernorm.weight"):  # (Jamba's)
                p.normal_(1.0, 0.3)
        routing_biases = [*model.named_buffers(), *model.named_parameters()]
        for name, b in routing_biases:  # DeepSeek-V3's (Ernie's) routing bias inits to 0
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.normal_(0.0, 0.5)
    dest = Path(dest)
    model.save_pretrained(dest, safe_serialization=True)
    if tokenizer_dir is None:
        write_wordlevel_tokenizer(dest, int(cfg["vocab_size"]))
    else:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copy(src, dest / name)
    return str(dest)


def write_random_lora(base_dir: str | Path, dest: str | Path, targets: list[str],
                      r: int = 8, alpha: float = 16, seed: int = 0, scale: float = 3.0,
                      safe_serialization: bool = True, **config: Any) -> str:
    """Save a random PEFT LoRA adapter for the checkpoint at ``base_dir``; return its path.

    PEFT's own ``get_peft_model`` and ``save_pretrained`` write it (B is random, not
    zero), and every LoRA matrix is multiplied by ``scale`` so the adapter moves the
    argmax. ``config`` goes to ``LoraConfig`` (``use_rslora``, ``rank_pattern``, ...);
    ``safe_serialization=False`` writes ``adapter_model.bin``. Needs ``peft``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(dest), safe_serialization=safe_serialization)
    return str(dest)


# Gemma 3 multimodal test files: special tokens at the top of a small vocabulary.
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
_GEMMA3_TURN_WORDS = ("<start_of_turn>", "<end_of_turn>", "user", "model")
# Gemma 3's chat template, cut to what the tests use: an image part is its
# begin-of-image token, as the released template renders it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def write_random_gemma3_multimodal(dest: str | Path, seed: int = 7, vocab_size: int = 300,
                                   image_size: int = 56, patch_size: int = 7,
                                   tokens_per_image: int = 16,
                                   vision_config: dict[str, Any] | None = None,
                                   **text: Any) -> str:
    """Save a random ``Gemma3ForConditionalGeneration`` (a small SigLIP tower, its
    projector, a Gemma 3 decoder) with a word-level tokenizer whose last ids are the
    image tokens (``GEMMA3_IMAGE_TOKENS``: begin, end, soft token) and a Gemma-style
    chat template; return its path. ``text`` overrides the decoder's config,
    ``vision_config`` the tower's."""
    import transformers as tf

    words = (*_GEMMA3_TURN_WORDS, *GEMMA3_IMAGE_TOKENS)
    boi, eoi, image = (vocab_size - 3, vocab_size - 2, vocab_size - 1)
    text_cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    text_cfg.update(text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=image_size, patch_size=patch_size,
                  vision_use_head=False)
    vision.update(vision_config or {})
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text_cfg, vision_config=vision, mm_tokens_per_image=tokens_per_image,
        image_token_index=image, boi_token_index=boi, eoi_token_index=eoi,
        bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mm_input_projection" in name:  # zeros at init: images would add nothing
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2 and "vision" not in name:
                p.mul_(4.0)
            elif p.dim() < 2:
                p.normal_(0.0, 0.5 if "norm" in name else 0.2)
    dest = Path(dest)
    model.save_pretrained(dest, safe_serialization=True)
    write_wordlevel_tokenizer(dest, vocab_size, words, (*words[:2], *GEMMA3_IMAGE_TOKENS),
                              GEMMA3_CHAT_TEMPLATE)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(
        str(dest))
    return str(dest)


def random_picture(seed: int, size: tuple[int, int] = (40, 30)) -> Any:
    """An RGB PIL image of random pixels (``size`` is width, height), for image tests."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def _spread_weights(model: Any, tower: str, norms: tuple[str, ...]) -> None:
    """Give a random multimodal model's weights teeth, in parameter order (so a seed
    gives the same file): vectors around 1 (norms, names holding one of ``norms``) or
    0 (biases) with spread 0.2, the tower's matrices (names holding ``tower``) drawn
    N(0, 0.2), the decoder's scaled by 4."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.normal_(1.0 if any(n in name for n in norms) else 0.0, 0.2)
            elif tower in name:
                p.normal_(0.0, 0.2)
            else:
                p.mul_(4.0)


# LLaVA test files: the image token last in a small vocabulary, chat words before it.
_LLAVA_WORDS = ("USER:", "ASSISTANT:", "<image>")
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'video' %}<video>\n"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def write_random_llava(dest: str | Path, seed: int = 11, vocab_size: int = 300,
                       image_size: int = 28, patch_size: int = 7,
                       strategy: str = "default", pinpoints: list[list[int]] | None = None,
                       onevision_max_crops: int | None = None, **text: Any) -> str:
    """Save a random ``LlavaForConditionalGeneration`` (a 2-layer CLIP tower, LLaVA's
    projector, a Llama decoder) with a word-level tokenizer whose last id is
    ``<image>`` and a LLaVA-1.5-style chat template, plus CLIP's image processor
    config; return its path. With ``pinpoints``, a ``LlavaNextForConditionalGeneration``
    over those canvases and LLaVA-NeXT's processor instead; with ``onevision_max_crops``
    too, a ``LlavaOnevisionForConditionalGeneration`` (a SigLIP tower, ``anyres_max_N``,
    ``<video>`` the id before the chat words) and its processor. ``text`` overrides the
    decoder's config."""
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    text_cfg = dict(model_type="llama", vocab_size=vocab_size, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                    eos_token_id=2)
    text_cfg.update(text)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
                  patch_size=patch_size, hidden_act="quick_gelu", projection_dim=32)
    torch.manual_seed(seed)
    kw = dict(text_config=text_cfg, vision_config=vision, image_token_index=vocab_size - 1,
              vision_feature_select_strategy=strategy, vision_feature_layer=-2)
    if onevision_max_crops is not None:
        vision.update(model_type="siglip_vision_model", hidden_act="gelu_pytorch_tanh",
                      vision_use_head=False)
        vision.pop("projection_dim")
        kw.update(vision_feature_select_strategy="full", vision_feature_layer=-1,
                  video_token_index=vocab_size - 1 - len(_LLAVA_WORDS))
        model = tf.LlavaOnevisionForConditionalGeneration(tf.LlavaOnevisionConfig(
            **kw, image_grid_pinpoints=pinpoints,
            vision_aspect_ratio=f"anyres_max_{onevision_max_crops}"))
    elif pinpoints is None:
        model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(**kw))
    else:
        model = tf.LlavaNextForConditionalGeneration(tf.LlavaNextConfig(
            **kw, image_grid_pinpoints=pinpoints))
    _spread_weights(model, "vision", ("norm",))
    dest = Path(dest)
    model.save_pretrained(dest, safe_serialization=True)
    words, specials = _LLAVA_WORDS, ("<image>",)
    if onevision_max_crops is not None:
        words, specials = ("<video>", *words), ("<video>", *specials)
    write_wordlevel_tokenizer(dest, vocab_size, words, specials, LLAVA_CHAT_TEMPLATE)
    sizes = dict(size={"shortest_edge": image_size},
                 crop_size={"height": image_size, "width": image_size})
    if onevision_max_crops is not None:
        processor = LlavaOnevisionImageProcessorPil(
            size={"height": image_size, "width": image_size}, image_grid_pinpoints=pinpoints)
    elif pinpoints is None:
        processor = CLIPImageProcessorPil(**sizes)
    else:
        processor = LlavaNextImageProcessorPil(**sizes, image_grid_pinpoints=pinpoints)
    processor.save_pretrained(str(dest))
    return str(dest)
