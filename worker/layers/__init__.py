"""Tensor-parallel building blocks of the Llama-family model."""
