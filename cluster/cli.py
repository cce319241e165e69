"""The ``pagedserve`` command: generate offline, serve the OpenAI API, run request files.

``generate`` runs the offline engine, ``serve`` the OpenAI-compatible API, and
``run-batch`` a file of OpenAI batch requests through it (``run_batch``); ``cache`` lists
or prunes the converted models and compiled kernels (``cache_cmd``).

``pagedserve`` with no arguments serves the embedded default model (SmolLM2-135M-Instruct)
on http://127.0.0.1:8000. ``serve`` starts a fresh local Ray instance unless it is given
``--address`` (or ``RAY_ADDRESS``; ``--address auto`` joins the cluster started on this
machine with ``ray start``), deploys the Serve application, prints the URL and blocks until
Ctrl-C or SIGTERM, then removes what it created: the application, and Serve and Ray too
when it started them. Open requests get ``--drain-timeout-s`` to finish first; a second
Ctrl-C stops at once (``local_app``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.cluster import cache_cmd
from pagedserve.cluster.http_front import INGRESS_MODES
from pagedserve.scheduler.sampling_params import REASONING_FORMATS


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="cut the layers into this many stages, each its own tensor-parallel "
                        "group of Ray actors (for a model one group cannot hold)")
    p.add_argument("--pipeline-layer-partition", default=None, metavar="N,N,...",
                   help="layers of each pipeline stage (default: as even as they divide); "
                        "fewer on the last stage where the LM head costs several layers")
    p.add_argument("--max-concurrent-batches", type=int, default=None, metavar="N",
                   help="step plans in flight at once under pipeline parallelism "
                        "(default: one per stage, so no stage idles; 1: one at a time)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", default="auto",
                   help="weights, activations and KV cache: auto (bf16 on CUDA, fp32 on CPU), "
                        "float32, bfloat16 or float16")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV cache element type: auto (the model's), float16, bfloat16, fp8 "
                        "(= fp8_e4m3) or fp8_e5m2; narrower types hold 2x / 4x the tokens")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV: per-layer scales from a calibration text's keys and values "
                        "(default: scale 1.0)")
    p.add_argument("--quantization", "-q", default=None,
                   choices=("int8", "int4", "gptq", "awq", "compressed-tensors", "fp8", "mxfp4"),
                   help="int8: projections as 8-bit weights (a scale per 32 inputs) run on "
                        "int8 activations, ~3.5x less weight memory than fp32; int4: 4-bit "
                        "weights (scale and minimum per 32), about half that again; on CUDA "
                        "int4 only (16-bit activations, a Triton W4A16 GEMM); gptq, awq, "
                        "compressed-tensors, fp8, mxfp4: the checkpoint's own (vLLM's names; it "
                        "must say so), served dequantised")
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="mixtures of experts: each tensor-parallel rank holds whole routed "
                        "experts, a share of them, instead of a slice of every expert")
    p.add_argument("--expert-placement-strategy", choices=("linear", "round_robin"),
                   default="linear",
                   help="which experts a rank holds under --enable-expert-parallel: a "
                        "contiguous run, or every world-size-th (spreads expert groups)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs do not depend on what else is in "
                        "its batch, bit for bit (reproducible seeded sampling, exact "
                        "failover; CPU only, slower for short batches and long prompts)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer of a model that mixes full and "
                        "sliding-window layers (Gemma 2 / 3), whose sliding layers then "
                        "keep every block too (default: a table per kind of layer)")
    p.add_argument("--limit-mm-per-prompt", type=_json_object, default=None,
                   help='images one prompt may carry, as JSON ({"image": 4}; default 16); '
                        '{"image": 0} serves a multimodal Gemma 3 as text, its vision '
                        'encoder not loaded')
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image URLs may name local files under DIR (file://...); "
                        "default: no local files")
    p.add_argument("--mm-processor-kwargs", type=_json_object, default=None,
                   help='processor options as JSON, e.g. Gemma 3\'s {"do_pan_and_scan": '
                        'true} or Qwen2-VL\'s {"min_pixels": N, "max_pixels": N}')
    p.add_argument("--hf-overrides", type=_json_object, default=None,
                   help="keys laid over the model's config.json, as JSON; e.g. a causal LM "
                        'served as a reranker: {"architectures": '
                        '["Qwen3ForSequenceClassification"], "classifier_from_token": '
                        '["no", "yes"], "is_original_qwen3_reranker": true}')
    p.add_argument("--enable-prompt-embeds", action="store_true",
                   help="/v1/completions takes prompt_embeds: base64 torch.save tensors "
                        "[tokens, hidden] in place of text (loaded weights-only; only for "
                        "trusted clients)")
    p.add_argument("--logits-processors", nargs="+", default=None, metavar="CLASS",
                   help="custom logits processors, each 'pkg.module:Class' (a "
                        "pagedserve.worker.logits_processors.LogitsProcessor); requests "
                        "set theirs through vllm_xargs")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: sized from memory)")
    p.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                   help="GiB of CPU memory per rank for a second prefix-cache tier: blocks "
                        "evicted from the pool are kept there and loaded back on a hit")
    p.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none",
                   help="hybrid Mamba / DeltaNet models: 'align' turns prefix caching on, "
                        "keeping state snapshots at block boundaries")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="TOKENS",
                   help="at most this many of one prompt's tokens per step, so prompts "
                        "behind a long one start in the same steps (default 0: no cap)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per rank")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU for weights, activations and KV pool (CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (CUDA)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, vLLM\'s JSON: n-gram lookup '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\', suffix '
                        'decoding \'{"method": "suffix"}\' (earlier answers too) or a '
                        'draft model \'{"model": "/path/to/draft", "num_speculative_tokens": '
                        '4, "quantization": "int8"}\' or an EAGLE head \'{"method": "eagle3", '
                        '"model": "/path/to/head", "num_speculative_tokens": 3}\' or a '
                        'the model\'s own MTP layer \'{"method": "mtp"}\' (DeepSeek-V3, '
                        'Qwen3-Next, Qwen3.5)')


def _json_object(text: str) -> dict:
    """A JSON object from the command line, or argparse's usage error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text offline with the full engine")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    _engine_flags(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("-n", type=int, default=1, help="samples per prompt")
    g.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    g.add_argument("--lora", default=None, metavar="PATH",
                   help="generate with this PEFT LoRA adapter")
    g.add_argument("--max-lora-rank", type=int, default=16)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve")
    _serve_flags(s)

    b = sub.add_parser("run-batch", help="run a file of OpenAI batch requests through a "
                       "local deployment of the app (vLLM's run-batch)")
    _serve_flags(b)
    b.add_argument("-i", "--input-file", required=True,
                   help="JSONL of {custom_id, method, url, body} lines ('-': stdin)")
    b.add_argument("-o", "--output-file", required=True,
                   help="JSONL of {id, custom_id, response, error} lines, in input order "
                        "('-': stdout)")
    b.add_argument("--max-concurrency", type=int, default=64,
                   help="requests in flight at once")
    b.set_defaults(ingress="proxy", port=0, host="127.0.0.1")
    cache_cmd.add_parser(sub)
    return parser


def _serve_flags(s: argparse.ArgumentParser) -> None:
    """The app's settings, shared by ``serve`` and ``run-batch``."""
    _engine_flags(s)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API (several: each is accepted, the "
                        "first answers)")
    s.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: a request's 'priority' (lower first) orders admission "
                        "and preemption")
    s.add_argument("--priority-aging-s", type=float, default=None, metavar="SECONDS",
                   help="with --scheduling-policy priority: every SECONDS a request has "
                        "waited count as one priority level more urgent, so a steady stream "
                        "of urgent requests cannot starve it (default: strict priorities)")
    s.add_argument("--pooling-type", choices=("last", "mean", "cls"), default=None,
                   help="/v1/embeddings: the last token's final hidden state (decoder "
                        "embedders: e5-mistral, Qwen3-Embedding), the mean of all tokens', "
                        "or the first token's (BERT-family: bge); default: the model's "
                        "sentence-transformers pooling, else cls for an encoder, last for "
                        "a decoder")
    s.add_argument("--prefill-replicas", type=int, default=0,
                   help="disaggregated prefill: this many prefill-only replicas compute "
                        "prompts and ship their KV to the engine replicas, which decode")
    s.add_argument("--prefill-autoscaling-config", type=_json_object, default=None,
                   help="the prefill pool's own autoscaling_config (replaces the fixed "
                        "--prefill-replicas count, which must still be >= 1)")
    s.add_argument("--remote-prefill-min-tokens", type=int, default=64,
                   help="with --prefill-replicas: a prompt whose part missing from the "
                        "decode replica's cache is shorter is computed there")
    s.add_argument("--remote-prefill-max-inflight", type=int, default=None, metavar="N",
                   help="with --prefill-replicas: a decode replica waiting on N remote "
                        "prefills computes the next prompt itself (default: no bound)")
    s.add_argument("--reasoning-parser", choices=REASONING_FORMATS, default=None,
                   help="chat answers of thinking models: the text between <think> and "
                        "</think> goes to the message's 'reasoning', the rest to 'content'; "
                        "openai_gptoss: GPT-OSS's harmony channels (analysis: reasoning, "
                        "final: content, calls to functions.NAME: tool calls)")
    s.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (on by itself with --lora-modules/--lora-dir)")
    s.add_argument("--max-loras", type=int, default=1,
                   help="different LoRA adapters in one batch")
    s.add_argument("--max-lora-rank", type=int, default=16)
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapters loaded at start; requests name them in 'model'")
    s.add_argument("--lora-dir", default=None,
                   help="adapters loaded on first use: 'model': NAME serves LORA_DIR/NAME")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: "
                        "serve an adapter directory under a name at run time")
    s.add_argument("--enable-responses-store", action="store_true",
                   help="keep /v1/responses answers (store): previous_response_id, "
                        "background, GET/DELETE /v1/responses/{id} and cancel")
    s.add_argument("--responses-store-max-entries", type=int, default=10_000,
                   help="stored responses kept; past it the least recently used finished "
                        "one is dropped")
    s.add_argument("--max-loaded-loras", type=int, default=None,
                   help="adapters a replica keeps loaded; more unload the least recently "
                        "used idle one (default: 16, or --max-loras if more)")
    s.add_argument("--num-replicas", type=int, default=1, help="engine replicas")
    s.add_argument("--autoscaling-config", type=_json_object, default=None,
                   help='scale engine replicas with load, Serve\'s autoscaling_config: '
                        '\'{"min_replicas": 1, "max_replicas": 4, '
                        '"target_ongoing_requests": 16}\' (replaces --num-replicas)')
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    s.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a new local one)")
    s.add_argument("--name", default="pagedserve", help="Serve application name")
    s.add_argument("--route-prefix", default="/")
    s.add_argument("--max-ongoing-requests", type=int, default=64,
                   help="requests one engine replica accepts at once")
    s.add_argument("--max-queued-requests", type=int, default=128,
                   help="requests waiting for a replica before new ones get 503")
    s.add_argument("--ingress-replicas", type=int, default=1)
    s.add_argument("--no-ingress-on-head", dest="ingress_on_head", action="store_false",
                   help="let Serve place the ingress replicas on any node (default: on the "
                        "head, so that losing a worker node never breaks a client's "
                        "connection; its engine replicas' requests resume elsewhere)")
    s.add_argument("--stream-interval-ms", type=float, default=50.0,
                   help="send a stream's tokens at most once per interval, merged "
                        "(0: every step; Ray Serve LLM's default is 50)")
    s.add_argument("--stream-messages-per-s", type=float, default=None,
                   help="streamed messages per second one engine replica may send in all; "
                        "stretches the interval when many streams are open "
                        "(default: 25 per core, 0: no budget)")
    s.add_argument("--no-resume-streams", dest="resume_streams", action="store_false",
                   help="end a stream whose replica died with an error event instead of "
                        "resuming it on another replica from the tokens already sent")
    s.add_argument("--failover-wait-s", type=float, default=60.0,
                   help="a request moved off a dead replica waits this long for a replica "
                        "to take it (the replacement of the only one: raise it for models "
                        "that take minutes to load), then fails with a 503")
    s.add_argument("--drain-timeout-s", type=float, default=600.0,
                   help="a replica that is replaced (a redeploy), scaled down or stopped "
                        "finishes its open requests for up to this long; past it, an "
                        "engine replica's requests resume on another replica")
    s.add_argument("--graceful-shutdown-wait-loop-s", type=float, default=2.0,
                   help="a stopping replica looks for open requests this often, the "
                        "first time after one period (routers' time to stop sending to "
                        "it): what an idle replica's stop takes")
    s.add_argument("--checkpoint-interval-ms", type=float, default=1000.0,
                   help="a non-streamed request's replica sends the ingress its tokens "
                        "this often, so that it resumes from them if the replica dies "
                        "(0: no checkpoints, such requests start again)")
    s.add_argument("--burst-wait-ms", type=float, default=None,
                   help="an idle engine woken by a request waits until none has arrived "
                        "for this long (at most 5 times it, and no longer once a step is "
                        "full), so a burst starts as one batch (default: 5%% of the step "
                        "it would start, at most 20 ms; 0: off)")
    s.add_argument("--health-check-period-s", type=float, default=10.0)
    s.add_argument("--num-cpus", type=int, default=None, help="CPUs of a new local Ray")
    s.add_argument("--num-gpus", type=int, default=None, help="GPUs of a new local Ray")
    s.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too")
    s.add_argument("--ingress", choices=INGRESS_MODES, default="auto",
                   help="HTTP front of a new local Ray: 'haproxy' on --port in front of "
                        "each ingress replica's own port; 'proxy': Serve's Python proxy; "
                        "'direct': the proxy, and the replicas' ports printed at start; "
                        "'auto' (default): haproxy where ray[serve] installed its binary")


def install_stop_handlers() -> list[int]:
    """SIGINT / SIGTERM handlers that only note the signal, in the list returned.

    A handler runs in the main thread between two bytecodes, wherever that thread is:
    one that took a lock (``threading.Event.set``) could find the lock held by the very
    code it interrupted (``Event.wait`` re-taking it after its timeout) and hang the
    server at Ctrl-C, which it did. Appending to a list takes no lock."""
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    return stop


def wait_for_stop(stop: list[int], poll_s: float = 0.2) -> int:
    """Block until ``install_stop_handlers`` noted a signal; returns the first one."""
    while not stop:
        time.sleep(poll_s)  # (a signal wakes it; the handler runs, the loop looks)
    return stop[0]


def serve_forever(args: argparse.Namespace) -> int:
    """Deploy, print the URL, block until a signal, then undo what this process started."""
    from pagedserve.cluster import http_front
    from pagedserve.cluster.local_app import SetupError, local_app

    try:
        with local_app(args, "serve") as (url, front):
            stop = install_stop_handlers()
            names = " / ".join(args.served_model_name or [args.model or "SmolLM2-135M"])
            print(f"pagedserve: serving {names}"
                  f" at {url}/v1 (health: {url}/health, metrics: {url}/metrics; "
                  f"front: {front})", flush=True)
            if front == "direct":
                for direct in http_front.direct_ingress_urls(args.name, args.host):
                    print(f"pagedserve: direct ingress at {direct}/v1", flush=True)
            wait_for_stop(stop)
            print("pagedserve: shutting down (open requests get up to "
                  f"{args.drain_timeout_s:g} s; Ctrl-C again to stop at once)", flush=True)
    except SetupError as e:
        print(f"pagedserve serve: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pagedserve`` script; no arguments means ``serve``."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args: Any = parser.parse_args(argv)
    if args.command == "generate":
        from pagedserve.cluster.generate_cmd import generate

        return generate(args)
    if args.command == "cache":
        return cache_cmd.run(args)
    if args.command == "run-batch":
        from pagedserve.cluster.run_batch import run_batch

        return run_batch(args)
    return serve_forever(args)


if __name__ == "__main__":
    sys.exit(main())
