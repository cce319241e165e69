"""M-RoPE positions and rotation against Hugging Face's Qwen2-VL: ``grid_positions``
equals ``get_rope_index`` on prompts with images of several grids (every chunk cut
too), ``step_positions`` shifts rows past their images by ``rope_delta``, and the
rotary tables recompose the three sections as ``Qwen2VLRotaryEmbedding`` does."""

from __future__ import annotations

import pytest
import torch

from pagedserve.scheduler.multimodal import ImageInput, mrope_grids, rope_delta
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.mrope_positions import grid_positions, step_positions

PAD = 99


def hf_index(ids: list[int], grids: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """Hugging Face's ``get_rope_index`` positions ``[3, n]`` and delta for a prompt
    whose image runs have ``grids`` (rows, cols) of LLM tokens."""
    from transformers import Qwen2VLConfig, Qwen2VLModel

    cfg = Qwen2VLConfig(text_config=dict(hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         intermediate_size=16, vocab_size=128),
                        vision_config=dict(depth=1, embed_dim=8, num_heads=1, hidden_size=16),
                        image_token_id=PAD)
    model = Qwen2VLModel(cfg)
    x = torch.tensor([ids])
    thw = torch.tensor([[1, 2 * r, 2 * c] for r, c in grids]) if grids else None
    if thw is None:  # text only: Hugging Face leaves positions to the model (0, 1, ...)
        return torch.arange(len(ids)).expand(3, -1), 0
    pos, delta = model.get_rope_index(x, mm_token_type_ids=(x == PAD).int(),
                                      image_grid_thw=thw)
    return pos[:, 0], int(delta[0, 0])


def prompt(layout: list) -> tuple[list[int], list[ImageInput]]:
    """Text runs (an int: that many tokens), images (rows, cols) and videos (times, rows,
    cols) in order."""
    ids: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, int):
            ids += [5 + i % 7 for i in range(part)]
        else:
            times, rows, cols = part if len(part) == 3 else ((0,), *part)
            start = len(ids)
            ids += [PAD] * (len(times) * rows * cols)
            images.append(ImageInput(start, len(ids), f"k{start}", None, (rows, cols), True,
                                     times))
    return ids, images


LAYOUTS = [
    [3, (2, 3), 4],
    [(3, 1), 2, (1, 4), 1, (2, 2), 5],
    [1, (4, 4), 1],
    [6],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["one", "three", "square", "text"])
def test_grid_positions_equal_hugging_faces_rope_index(layout: list) -> None:
    ids, images = prompt(layout)
    want, delta = hf_index(ids, [img.grid for img in images])
    assert rope_delta(images) == delta
    n = len(ids)
    assert torch.equal(grid_positions(0, n, mrope_grids(images, n)), want)
    for cut in range(1, n):  # every chunk split: each half from its own grids
        head = grid_positions(0, cut, mrope_grids(images, cut))
        tail = grid_positions(cut, n - cut, mrope_grids(images, n))
        assert torch.equal(torch.cat([head, tail], dim=1), want)
    later = torch.arange(n, n + 3)  # decode: past the prompt, index + delta
    assert torch.equal(grid_positions(n, 3, mrope_grids(images, n + 3))[0], later + delta)


def test_step_positions_mix_gridded_chunks_shifted_rows_and_plain_rows() -> None:
    ids, images = prompt([2, (2, 3), 3])
    n = len(ids)
    chunk = ScheduledRequest("a", ids[:8], 0, [0, 1], [], mrope_grids=mrope_grids(images, 8),
                             rope_delta=rope_delta(images))
    decode = ScheduledRequest("b", [7], n, [2, 3], ["b"], rope_delta=rope_delta(images))
    plain = ScheduledRequest("c", [7, 8], 4, [4], ["c"])
    q = [8, 1, 2]
    positions = torch.tensor([*range(8), n, 4, 5])
    seq_idx = torch.tensor([0] * 8 + [1, 2, 2])
    out = step_positions([chunk, decode, plain], q, positions, seq_idx)
    want, delta = hf_index(ids, [(2, 3)])
    assert torch.equal(out[:, :8], want[:, :8])
    assert out[:, 8].tolist() == [n + delta] * 3
    assert out[:, 9:].tolist() == [[4, 5]] * 3
    no_grids = step_positions([decode, plain], [1, 2], torch.tensor([n, 4, 5]),
                              torch.tensor([0, 1, 1]))
    assert no_grids.tolist() == [n + delta, 4, 5]  # 1-D: what CUDA graphs replay


def test_rotary_sections_recompose_as_hugging_face() -> None:
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    cfg = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    hf = Qwen2VLRotaryEmbedding(cfg)
    ours = RotaryEmbedding(16, 10000.0, None, torch.device("cpu"), mrope_section=(2, 3, 3))
    pos = torch.tensor([[0, 3, 3, 3, 7], [1, 3, 4, 4, 7], [2, 3, 4, 5, 7]])
    cos, sin = hf(torch.zeros(1, 5, 16), pos[:, None])
    our_cos, our_sin = ours.cos_sin(pos, torch.float32)
    torch.testing.assert_close(our_cos[:, 0], cos[0, :, :8], rtol=0, atol=0)
    torch.testing.assert_close(our_sin[:, 0], sin[0, :, :8], rtol=0, atol=0)
    flat_cos, _ = ours.cos_sin(pos[0], torch.float32)  # 1-D: all three sections equal
    same_cos, _ = ours.cos_sin(pos[0].expand(3, -1), torch.float32)
    assert torch.equal(flat_cos, same_cos)


def test_a_grid_that_does_not_hold_its_span_is_refused() -> None:
    with pytest.raises(ValueError, match="grid"):
        ImageInput(0, 5, "k", None, (2, 3))


# Released files' config.json, as they were saved (transformers 4.4x: the decoder's
# fields at the top level, ``rope_scaling`` naming the M-RoPE sections).
QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 12,
    "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                      "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}
QWEN2_5_VL_3B = {
    **QWEN2_VL_2B, "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl", "hidden_size": 2048, "intermediate_size": 11008,
    "num_attention_heads": 16, "num_hidden_layers": 36,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                      "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "rope_type": "default"},
}


@pytest.mark.parametrize("cfg", [QWEN2_VL_2B, QWEN2_5_VL_3B], ids=["qwen2-vl", "qwen2.5-vl"])
def test_released_configs_read_as_a_qwen2_decoder_with_mrope(cfg: dict) -> None:
    from pagedserve.worker.config import ModelConfig
    from pagedserve.worker.models.qwen2_vision import Qwen2VisionConfig

    mc = ModelConfig.from_hf_dict(dict(cfg))
    assert (mc.model_type, mc.mrope_section, mc.rope_scaling) == ("qwen2", (16, 24, 24), None)
    assert (mc.rope_theta, mc.head_dim, mc.qkv_bias, mc.sliding_window) == (1e6, 128, True, None)
    assert mc.image is not None and mc.image.family == "qwen2_vl"
    assert (mc.image.image_token_id, mc.image.bidirectional) == (151655, False)
    vision = Qwen2VisionConfig.from_hf(dict(cfg))
    assert vision.out_hidden_size == mc.hidden_size


def test_bad_mrope_sections_are_refused_naming_the_field() -> None:
    from pagedserve.worker.config import ModelConfig

    for section, match in (([16, 24], "three positive ints"), ([16, 24, 32], "add up")):
        bad = {**QWEN2_VL_2B, "rope_scaling": {"type": "mrope", "mrope_section": section}}
        with pytest.raises(ValueError, match=match) as err:
            ModelConfig.from_hf_dict(bad)
        assert "mrope_section" in str(err.value)


def reference_index(layout: list) -> torch.Tensor:
    """Qwen2-VL's reference ``get_rope_index`` (transformers 4.45, vLLM's
    ``MRotaryEmbedding``): a text run continues from one past the largest position so far
    on any axis; a grid ``(times, rows, cols)`` puts slice ``k``'s token ``(r, c)`` at
    ``(p + times[k], p + r, p + c)``."""
    parts, start = [], 0
    for part in layout:
        if isinstance(part, int):
            parts.append(torch.arange(part).expand(3, -1) + start)
        else:
            times, rows, cols = part
            t, h, w = torch.meshgrid(torch.tensor(times), torch.arange(rows),
                                     torch.arange(cols), indexing="ij")
            parts.append(torch.stack([t.flatten(), h.flatten(), w.flatten()]) + start)
        start = int(parts[-1].max()) + 1
    return torch.cat(parts, dim=1)


VIDEO_LAYOUTS = [
    [3, ((0, 1, 2), 3, 3), 4],  # Qwen2-VL: a slice a step
    [2, ((0,), 2, 3), 1, ((0, 1, 3), 4, 4), 2],  # a picture, then Qwen2.5-VL times
    [1, ((0, 4, 9), 2, 2), 3, ((0, 1), 1, 2), 2],  # times past the grid
]


@pytest.mark.parametrize("layout", VIDEO_LAYOUTS, ids=["steps", "scaled", "long"])
def test_video_positions_equal_the_reference_rope_index(layout: list) -> None:
    ids, images = prompt(layout)
    want = reference_index(layout)
    n = len(ids)
    assert torch.equal(grid_positions(0, n, mrope_grids(images, n)), want)
    for cut in range(1, n):
        head = grid_positions(0, cut, mrope_grids(images, cut))
        tail = grid_positions(cut, n - cut, mrope_grids(images, n))
        assert torch.equal(torch.cat([head, tail], dim=1), want)
    assert rope_delta(images) == int(want.max()) + 1 - n
    assert torch.equal(grid_positions(n, 2, mrope_grids(images, n + 2))[0],
                       torch.arange(n, n + 2) + rope_delta(images))


def test_hugging_face_places_a_video_within_its_grid_as_the_reference() -> None:
    """transformers 5 continues text after a video from ``max(rows, cols)`` (not past the
    video's last time): the same wherever the times stay within the grid, as here, and
    Qwen2.5-VL's slice times are HF's ``(arange(t) * tokens_per_second * seconds).long()``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    from pagedserve.worker.video_pixels import slice_times

    times = slice_times(3, 0.5, 3.0)
    assert times == (0, 1, 3)
    layout = [2, (times, 4, 4), 3]
    ids, images = prompt(layout)
    cfg = Qwen2_5_VLConfig(text_config=dict(hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1,
                                            intermediate_size=16, vocab_size=128),
                           vision_config=dict(depth=1, hidden_size=8, num_heads=1,
                                              out_hidden_size=16, tokens_per_second=3),
                           video_token_id=PAD)
    x = torch.tensor([ids])
    pos, delta = Qwen2_5_VLModel(cfg).get_rope_index(
        x, mm_token_type_ids=2 * (x == PAD).int(), video_grid_thw=torch.tensor([[3, 8, 8]]),
        second_per_grid_ts=torch.tensor([0.5]))
    assert torch.equal(pos[:, 0], reference_index(layout))
    assert torch.equal(grid_positions(0, len(ids), mrope_grids(images, len(ids))), pos[:, 0])
    assert rope_delta(images) == int(delta[0, 0])
