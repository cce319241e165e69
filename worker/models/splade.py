"""A SPLADE encoder's head: BERT's masked-LM head turned into one sparse vector.

The head (``cls.predictions``: dense, GELU, LayerNorm, then the decoder, tied to
the word embedding, plus a bias) gives each token's vocabulary logits; SPLADE
keeps ``log(1 + relu(logit))`` and pools them over the prompt's tokens by max or
sum (``splade_config``). The whole head sits on every rank (the decoder is the
full word-embedding matrix, not a rank's share), runs in fp32, and goes through
the tokens in blocks so a long prompt never holds all its ``[tokens, vocab]``
logits at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Tokens a block: their logits are ``BLOCK x vocab`` fp32 (31 MB at BERT's 30,522).
BLOCK = 256


class SpladeHead(nn.Module):
    """``pool(log1p(relu(decoder(norm(gelu(dense(h)))))))`` over a prompt's rows. Not
    linear: the runner hands it the prompt's rows, whole."""

    linear = False

    def __init__(self, vocab: int, hidden: int, eps: float, approximate: str, strategy: str,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.dense_weight, self.dense_bias = param(hidden, hidden), param(hidden)
        self.norm_weight, self.norm_bias = param(hidden), param(hidden)
        self.decoder_weight, self.decoder_bias = param(vocab, hidden), param(vocab)
        self.eps, self.approximate, self.strategy = eps, approximate, strategy

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's names (under ``cls.predictions.``) of this head's tensors; the
        decoder's weight is the word embedding's when the file ties them."""
        return {"transform.dense.weight": self.dense_weight,
                "transform.dense.bias": self.dense_bias,
                "transform.LayerNorm.weight": self.norm_weight,
                "transform.LayerNorm.bias": self.norm_bias,
                "decoder.weight": self.decoder_weight, "bias": self.decoder_bias}

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Masked-LM logits ``[n, vocab]`` of token states ``[n, hidden]``."""
        h = F.gelu(F.linear(rows.float(), self.dense_weight.float(), self.dense_bias.float()),
                   approximate=self.approximate)
        h = F.layer_norm(h, h.shape[-1:], self.norm_weight.float(), self.norm_bias.float(),
                         self.eps)
        return F.linear(h, self.decoder_weight.float(), self.decoder_bias.float())

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The prompt's sparse vector ``[vocab]`` from its token states ``[n, hidden]``."""
        out: torch.Tensor | None = None
        for i in range(0, rows.shape[0], BLOCK):
            scores = torch.log1p(torch.relu(self.logits(rows[i:i + BLOCK])))
            part = scores.amax(0) if self.strategy == "max" else scores.sum(0)
            out = part if out is None else (torch.maximum(out, part) if self.strategy == "max"
                                            else out + part)
        assert out is not None, "a prompt has at least one token"
        return out
