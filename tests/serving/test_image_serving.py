"""Images over HTTP: a random multimodal Gemma 3 in an engine replica of two TP ranks
(Ray actors, each with its vision encoder), its pictures cut by pan-and-scan
(``mm_processor_kwargs``), answers chat completions whose messages hold
OpenAI image parts (a data URL, an http URL on loopback, a file under
``allowed_local_media_path``) as the in-process engine does; bad images are 400s on
``messages`` and leave the replica at its baseline. A Qwen2-VL replica's picture runs
are counted at the ingress."""

from __future__ import annotations

import base64
import http.server
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import random_picture as picture
from pagedserve.worker.testing import write_random_gemma3_multimodal, write_random_llava
from pagedserve.worker.testing_qwen_vl import write_random_qwen2_vl
from tests.serving.conftest import App, Cluster, loopback_http

pytestmark = [pytest.mark.ray, pytest.mark.slow]
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "t5 t6"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "t7"}]}]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png(picture(11)))
    return root


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # (seed 8: its answer depends on which picture it sees, crops and all)
    return write_random_gemma3_multimodal(tmp_path_factory.mktemp("models") / "gemma3-mm",
                                          seed=8)


@pytest.fixture(scope="module")
def mm_app(cluster: Cluster, mm_dir: str, media: Path) -> Iterator[App]:
    app = cluster.deploy("images", {"model": mm_dir, "served_model_name": "tiny-gemma3",
                                    "tensor_parallel_size": 2, "num_gpu_blocks": 64,
                                    "num_threads": 1, "allowed_local_media_path": str(media),
                                    "mm_processor_kwargs": PAN_AND_SCAN})
    yield app
    cluster.delete("images")


@pytest.fixture(scope="module")
def image_server(media: Path) -> Iterator[str]:
    """A loopback HTTP server handing out ``media``'s files."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, directory=str(media), **kw)

        def log_message(self, *args) -> None:
            pass

    with loopback_http(Quiet) as base:
        yield base


def test_image_chat_over_http_equals_the_offline_engine(
        mm_app: App, mm_dir: str, media: Path, image_server: str) -> None:
    client = mm_app.openai()
    kw = dict(model="tiny-gemma3", max_tokens=8, temperature=0.0,
              extra_body={"ignore_eos": True})
    img = picture(11)  # 40 x 30: two crops besides the whole
    llm = LLM(model=mm_dir, num_gpu_blocks=64, mm_processor_kwargs=PAN_AND_SCAN)
    try:
        ref = llm.chat(messages(data_url(img)), SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        other = llm.chat(messages(data_url(picture(12))), SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        plain = llm.chat(messages(data_url(img)), SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True),
            mm_processor_kwargs={"do_pan_and_scan": False})[0]
    finally:
        llm.shutdown()
    assert ref.outputs[0].text != other.outputs[0].text  # the image decides the answer
    assert ref.prompt_token_ids.count(299) == 3 * 16  # a run for the picture and each crop
    whole = client.chat.completions.create(messages=messages(data_url(img)), **{
        **kw, "extra_body": {"ignore_eos": True,
                             "mm_processor_kwargs": {"do_pan_and_scan": False}}})
    assert plain.prompt_token_ids.count(299) == 16  # this request's picture: not cut
    assert whole.usage.prompt_tokens == len(plain.prompt_token_ids)
    assert whole.choices[0].message.content == plain.outputs[0].text
    for url in (data_url(img), f"{image_server}/a.png", (media / "a.png").as_uri()):
        out = client.chat.completions.create(messages=messages(url), **kw)
        assert out.choices[0].message.content == ref.outputs[0].text, url
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages(data_url(img)), stream=True, **kw) if c.choices)
    assert streamed == ref.outputs[0].text
    tokens = httpx.post(f"{mm_app.base}/tokenize", headers=mm_app.headers, timeout=60,
                        json={"model": "tiny-gemma3", "messages": messages(data_url(img))})
    assert tokens.json()["tokens"] == ref.prompt_token_ids  # the runs written out
    mm_app.wait_baseline()


def post_chat(app: App, body: dict) -> httpx.Response:
    return httpx.post(f"{app.base}/v1/chat/completions", json=body, headers=app.headers,
                      timeout=60)


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,!!!", "base64"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "image"),
    ("file:///etc/hostname", "allowed"),
    ("ftp://127.0.0.1/a.png", "scheme"),
])
def test_a_bad_image_is_a_400_on_messages(mm_app: App, url: str, match: str) -> None:
    r = post_chat(mm_app, {"model": "tiny-gemma3", "messages": messages(url), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and match in err["message"], err
    mm_app.wait_baseline()


def test_a_text_model_refuses_image_parts(smol: App) -> None:
    r = post_chat(smol, {"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
                         "messages": messages(data_url(picture(1)))})
    assert r.status_code == 400, r.text
    assert "takes no images" in r.json()["error"]["message"]


def test_responses_input_image_answers_as_chat_does(mm_app: App) -> None:
    """``/v1/responses`` takes ``input_image`` parts (an ``image_url`` string) as chat's
    image parts; ``file_id`` is refused."""
    url = data_url(picture(13))
    chat = mm_app.openai().chat.completions.create(
        model="tiny-gemma3", messages=messages(url), max_tokens=6, temperature=0.0)
    content = [{"type": "input_text", "text": "t5 t6"},
               {"type": "input_image", "image_url": url},
               {"type": "input_text", "text": "t7"}]
    r = httpx.post(f"{mm_app.base}/v1/responses", headers=mm_app.headers, timeout=60, json={
        "model": "tiny-gemma3", "max_output_tokens": 6, "temperature": 0.0,
        "input": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    text = "".join(c["text"] for item in r.json()["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text")
    assert text == chat.choices[0].message.content
    content[1] = {"type": "input_image", "file_id": "file-1"}
    r = httpx.post(f"{mm_app.base}/v1/responses", headers=mm_app.headers, timeout=60, json={
        "model": "tiny-gemma3", "input": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and "file_id" in r.json()["error"]["message"], r.text
    mm_app.wait_baseline()


@pytest.fixture(scope="module")
def qwen_app(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[App, str]]:
    model_dir = write_random_qwen2_vl(tmp_path_factory.mktemp("models") / "qwen2-vl")
    app = cluster.deploy("qwen-images", {"model": model_dir, "num_threads": 1,
                                         "served_model_name": "tiny-qwen2-vl",
                                         "tensor_parallel_size": 2, "num_gpu_blocks": 3})
    yield app, model_dir
    cluster.delete("qwen-images")


def test_qwen2_vl_chat_counts_its_picture_run_at_the_front(qwen_app: tuple[App, str]) -> None:
    """A Qwen2-VL picture's run depends on its size: the ingress writes it out from
    the decoded picture, so a chat without ``max_tokens`` gets the room the pool
    really leaves (48 tokens: 3 blocks), not one that counts the run as one token
    (which the replica would refuse), and ``/tokenize`` shows the engine's ids. Two TP
    ranks place the tokens by M-RoPE alike: the answer equals the offline engine's."""
    ids = front_counts(*qwen_app, "tiny-qwen2-vl", (64, 64))
    assert ids.count(299) == 16  # a 64 x 64 picture: 4 x 4 tokens
    ids = front_counts(*qwen_app, "tiny-qwen2-vl", (64, 64), options={"max_pixels": 8 * 196})
    assert ids.count(299) == 4  # the request's own bound: 2 x 2 tokens
    app = qwen_app[0]
    r = post_chat(app, {"model": "tiny-qwen2-vl", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "t5"}],
                        "mm_processor_kwargs": {"do_pan_and_scan": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mm_processor_kwargs"
    assert "not an option of qwen2_vl's processor" in r.json()["error"]["message"]


def test_qwen2_vl_chat_takes_a_video_url(qwen_app: tuple[App, str]) -> None:
    """A ``video_url`` part (an MP4 as a data URL, 4 frames at 2 a second): the ingress
    decodes and samples it and counts its run (2 slices of 2 x 2 tokens), the answer
    equals the offline engine's, ``/tokenize`` shows the same ids; an undecodable video
    is a 400 naming ``messages``."""
    pytest.importorskip("av")
    from pagedserve.worker.testing_qwen_vl import video_bytes

    url = "data:video/mp4;base64," + base64.b64encode(
        video_bytes(2, frames=4, fps=2, size=(28, 28))).decode()
    ids = front_counts(*qwen_app, "tiny-qwen2-vl", parts=[
        {"type": "video_url", "video_url": {"url": url}}])
    assert ids.count(292) == 2 * 2 * 2
    ids = front_counts(*qwen_app, "tiny-qwen2-vl", options={"num_frames": 2}, parts=[
        {"type": "video_url", "video_url": {"url": url}}])
    assert ids.count(292) == 2 * 2  # the request's own sampling: one slice
    app = qwen_app[0]
    bad = "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()
    r = httpx.post(f"{app.base}/v1/chat/completions", headers=app.headers, timeout=60,
                   json={"model": "tiny-qwen2-vl", "messages": [{"role": "user", "content": [
                       {"type": "video_url", "video_url": {"url": bad}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "video_url: not a decodable video" in r.json()["error"]["message"]
    app.wait_baseline()


@pytest.fixture(scope="module")
def next_app(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[App, str]]:
    model_dir = write_random_llava(tmp_path_factory.mktemp("models") / "llava-next", seed=13,
                                   patch_size=14, pinpoints=[[28, 56], [56, 28], [56, 56]])
    app = cluster.deploy("next-images", {"model": model_dir, "num_threads": 1,
                                         "served_model_name": "tiny-llava-next",
                                         "num_gpu_blocks": 3})
    yield app, model_dir
    cluster.delete("next-images")


def test_llava_next_chat_counts_its_picture_run_at_the_front(next_app: tuple[App, str]) -> None:
    """LLaVA-NeXT's run depends on the picture's shape too (its crop grid, unpadded):
    the ingress counts it as the engine does."""
    ids = front_counts(*next_app, "tiny-llava-next", (60, 30))
    # 60 x 30 goes on the 28 x 56 canvas: 2 x 2 for the whole, the 2 x 4 grid, 2 newlines.
    assert ids.count(299) == 4 + 2 * 4 + 2
    app = next_app[0]  # a model without videos: a 400 before any replica is asked
    r = httpx.post(f"{app.base}/v1/chat/completions", headers=app.headers, timeout=60,
                   json={"model": "tiny-llava-next", "messages": [{"role": "user", "content": [
                       {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"}}]}]})
    assert r.status_code == 400 and "takes no videos" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def onevision_app(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[App, str]]:
    model_dir = write_random_llava(tmp_path_factory.mktemp("models") / "onevision", seed=13,
                                   patch_size=14, pinpoints=[[28, 28], [28, 56], [56, 56]],
                                   onevision_max_crops=1)
    app = cluster.deploy("ov-images", {"model": model_dir, "num_threads": 1,
                                       "served_model_name": "tiny-onevision",
                                       "num_gpu_blocks": 3})
    yield app, model_dir
    cluster.delete("ov-images")


def test_llava_onevision_chat_counts_each_pictures_run_at_the_front(
        onevision_app: tuple[App, str]) -> None:
    """LLaVA-OneVision's run depends on how many pictures the prompt holds: two get
    their whole picture only (2 x 2 features and a newline each); a video beside one
    picture leaves it anyres, and its run is counted from its sampled frames."""
    ids = front_counts(*onevision_app, "tiny-onevision", (60, 30), (20, 50))
    assert ids.count(299) == 2 * (4 + 1)
    pytest.importorskip("av")
    from pagedserve.worker.testing_qwen_vl import video_bytes

    url = "data:video/mp4;base64," + base64.b64encode(
        video_bytes(5, frames=4, fps=2, size=(28, 28))).decode()
    ids = front_counts(*onevision_app, "tiny-onevision", (60, 30), parts=[
        {"type": "video_url", "video_url": {"url": url}}])
    assert ids.count(296) == 4 * 1 + 1  # a video: 4 frames of one pooled feature, a newline


def front_counts(app: App, model_dir: str, name: str, *sizes: tuple[int, int],
                 parts: list[dict] | None = None, options: dict | None = None) -> list[int]:
    """Chat with a picture of each of ``sizes`` (and ``parts``) and no ``max_tokens``
    (under ``options``, the request's ``mm_processor_kwargs``): the usage and the answer
    equal the offline engine's, which fills the 3-block pool; ``/tokenize`` gives its
    ids. Returns them."""
    chat = [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(picture(3 + i, size))}}
          for i, size in enumerate(sizes)), *(parts or []),
        {"type": "text", "text": "t5 t6"}]}]
    llm = LLM(model=model_dir, num_gpu_blocks=3)
    try:
        ids = llm.chat(chat, SamplingParams(max_tokens=1),
                       mm_processor_kwargs=options)[0].prompt_token_ids
        room = 48 - len(ids)
        ref = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=room,
                                            ignore_eos=True), mm_processor_kwargs=options)[0]
    finally:
        llm.shutdown()
    out = app.openai().chat.completions.create(
        model=name, messages=chat, temperature=0.0,
        extra_body={"ignore_eos": True, "mm_processor_kwargs": options})
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == room
    assert out.choices[0].message.content == ref.outputs[0].text
    tokens = httpx.post(f"{app.base}/tokenize", headers=app.headers, timeout=60,
                        json={"model": name, "messages": chat, "mm_processor_kwargs": options})
    assert tokens.json()["tokens"] == ids
    app.wait_baseline()
    return ids
