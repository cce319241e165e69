"""Images in a prompt, as the scheduler sees them: spans of placeholder tokens.

An image enters a prompt as a run of placeholder tokens (Gemma 3: 256 soft tokens
between its begin- and end-of-image tokens) whose embeddings the worker replaces
with the vision encoder's output. Three scheduling rules follow from it, kept here
so each reads on its own:

- the tokens of one image attend to each other both ways (Gemma 3's mask), so a
  prefill chunk never ends inside such an image: the image's later tokens would be
  missing from its earlier ones' keys (``fit_chunk``). A ``causal`` image (LLaVA's,
  Qwen2-VL's) may be cut: its rows come from the encoder's output of the whole
  picture, kept between steps by the worker's encoder cache, as vLLM chunks them;
- every placeholder token id is the same, so a block's prefix-cache key carries the
  hashes of the images it overlaps (``block_image_keys``): two prompts with
  different images never share their image blocks, nor (the hashes chain) anything
  after them;
- a bidirectional image longer than one step's token budget could never be
  scheduled, so it is refused at admission (``check_images_fit``);
- under Qwen2-VL's multimodal RoPE (M-RoPE) an image of ``rows x cols`` tokens
  takes positions on a grid, ``max(rows, cols)`` of them along the sequence, so a
  request's later tokens turn by their index plus a delta (``rope_delta``), and a
  chunk that computes image rows carries the grids before it (``mrope_grids``). A
  video is such a grid repeated once per temporal slice (``times``: each slice's
  temporal position), its span ``len(times) * rows * cols`` tokens.

The pixel data is opaque here (a tensor the worker reads): the scheduler imports no
torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The key prefix of a span of prompt embeddings (``cluster.prompt_embeds``): rows the
# client computed itself, which the worker copies in as they are (no encoder).
EMBEDS_KEY = "embeds:"


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens ``[start, end)``, its content
    hash (its identity in prefix-cache keys) and its preprocessed pixels; ``grid``:
    the ``(rows, cols)`` of its tokens under M-RoPE (None: positions run 1-D);
    ``causal``: its tokens attend causally, so a prefill chunk may end inside it;
    ``times``: a video's temporal positions, one per slice of ``rows x cols`` tokens
    (an image: ``(0,)``, one slice)."""

    start: int
    end: int
    key: str
    pixels: Any
    grid: tuple[int, int] | None = None
    causal: bool = False
    times: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"image span [{self.start}, {self.end}) is empty or negative")
        if not self.times or any(b < a for a, b in zip(self.times, self.times[1:])) \
                or self.times[0] < 0:
            raise ValueError(f"video times {self.times} are not non-decreasing from >= 0")
        if self.grid is not None and \
                len(self.times) * self.grid[0] * self.grid[1] != self.end - self.start:
            raise ValueError(f"image grid {self.grid} x {len(self.times)} slices does not hold "
                             f"the span [{self.start}, {self.end})'s {self.end - self.start} "
                             "tokens")

    @property
    def is_embeds(self) -> bool:
        """Whether the span is prompt embeddings a client sent, not an image: its
        placeholder ids stand for no tokens (no repetition penalty counts them)."""
        return self.key.startswith(EMBEDS_KEY)

    @property
    def positions(self) -> int:
        """How far M-RoPE's positions advance over it: past its largest position on any
        axis (an image: ``max(rows, cols)``; a video: its last slice's time too, as
        Qwen2-VL's reference ``get_rope_index`` and vLLM count)."""
        assert self.grid is not None
        return max(self.times[-1], self.grid[0] - 1, self.grid[1] - 1) + 1


@dataclass(frozen=True)
class ImageChunk:
    """What one step computes of an image: rows ``[offset, offset + count)`` of a
    request's chunk take the encoder's output rows ``[first, first + count)``."""

    offset: int
    first: int
    count: int
    key: str
    pixels: Any

    @property
    def is_embeds(self) -> bool:
        """Rows of prompt embeddings (``ImageInput.is_embeds``): copied in, not encoded."""
        return self.key.startswith(EMBEDS_KEY)


def check_images(images: Sequence[ImageInput], num_prompt_tokens: int) -> None:
    """``ValueError`` unless the spans are ordered, disjoint and inside the prompt."""
    end = 0
    for i, img in enumerate(images):
        if img.start < end:
            raise ValueError(f"images[{i}]: span [{img.start}, {img.end}) overlaps the "
                             "previous image's or is out of order")
        if img.end > num_prompt_tokens:
            raise ValueError(f"images[{i}]: span [{img.start}, {img.end}) ends past the "
                             f"prompt's {num_prompt_tokens} tokens")
        end = img.end


def check_images_fit(images: Sequence[ImageInput], budget: int, cap: int = 0) -> None:
    """Refuse a bidirectional image no single step could compute whole: longer than
    the step's token budget (``max_num_batched_tokens``) or the per-prompt chunk cap
    (a causal one is computed in chunks)."""
    limit = min(budget, cap) if cap else budget
    for i, img in enumerate(images):
        if img.end - img.start > limit and not img.causal:
            what = "long_prefill_token_threshold" if cap and cap < budget \
                else "max_num_batched_tokens"
            raise ValueError(f"images[{i}] takes {img.end - img.start} tokens, more than "
                             f"{what} ({limit}): an image is computed in one step")


def fit_chunk(images: Sequence[ImageInput], start: int, num_new: int) -> int:
    """``num_new`` cut back so that tokens ``[start, start + num_new)`` do not stop
    inside a bidirectional image; 0 when the chunk starts inside or at one it cannot
    finish (the request waits for a step with room for the rest of the image)."""
    stop = start + num_new
    for img in images:
        if img.start < stop < img.end and not img.causal:
            return max(0, img.start - start)
        if img.start >= stop:
            break
    return num_new


def chunk_images(images: Sequence[ImageInput], start: int, num_new: int
                 ) -> tuple[list[ImageChunk], list[tuple[int, int]]]:
    """The image rows of tokens ``[start, start + num_new)`` and the bidirectional
    spans their attention needs (every bidirectional image the chunk computes part
    of, whole: a span may begin in cached context, a prefix-cache hit that stopped
    inside it; a causal one needs no span)."""
    stop = start + num_new
    chunks: list[ImageChunk] = []
    spans: list[tuple[int, int]] = []
    for img in images:
        if img.end <= start:
            continue
        if img.start >= stop:
            break
        lo, hi = max(img.start, start), min(img.end, stop)
        chunks.append(ImageChunk(lo - start, lo - img.start, hi - lo, img.key, img.pixels))
        if not img.causal:
            spans.append((img.start, img.end))
    return chunks, spans


def block_image_keys(images: Sequence[ImageInput], block_size: int, block: int
                     ) -> tuple[str, ...]:
    """Keys of the images that overlap block ``block`` (mixed into its hash)."""
    lo, hi = block * block_size, (block + 1) * block_size
    return tuple(f"image:{img.key}" for img in images if img.start < hi and img.end > lo)


def rope_delta(images: Sequence[ImageInput]) -> int:
    """What M-RoPE adds to the index of a token after all of ``images``: each image of
    ``rows x cols`` tokens advances the positions by ``max(rows, cols)``, not by its
    token count (Hugging Face's ``get_rope_index``; a video by ``ImageInput.positions``);
    0 without grids."""
    return sum(img.positions - (img.end - img.start) for img in images if img.grid)


MRopeGrid = tuple[int, int, int, tuple[int, ...]]


def mrope_grids(images: Sequence[ImageInput], stop: int) -> tuple[MRopeGrid, ...]:
    """``(start, rows, cols, times)`` of each gridded image that starts before token
    ``stop``: what the worker needs to place tokens ``< stop`` under M-RoPE."""
    return tuple((img.start, *img.grid, img.times) for img in images
                 if img.grid is not None and img.start < stop)
