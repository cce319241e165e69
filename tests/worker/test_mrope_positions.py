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


def prompt(layout: list[int | tuple[int, int]]) -> tuple[list[int], list[ImageInput]]:
    """Text runs (an int: that many tokens) and images (rows, cols) in order."""
    ids: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, int):
            ids += [5 + i % 7 for i in range(part)]
        else:
            start = len(ids)
            ids += [PAD] * (part[0] * part[1])
            images.append(ImageInput(start, len(ids), f"k{start}", None, part))
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
