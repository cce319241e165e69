"""Reading a user's image (``multimodal.load_image``): every source (bytes, a data URL,
a PIL image, a file under the allowed root, an http URL on a loopback server) gives
the same RGB pixels as Hugging Face's conversion, and every failure is a
``ValueError`` naming ``image_url``."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pagedserve.cluster.multimodal import load_image
from tests.serving.conftest import loopback_http
from tests.serving.test_multimodal_inputs import png_bytes, random_image, same_pixels


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def image() -> Image.Image:
    return random_image(np.random.default_rng(7))


# load_image: every source gives the same RGB pixels; every failure is a ValueError


def test_data_url_bytes_and_pil_give_the_same_rgb_pixels(image: Image.Image) -> None:
    data = png_bytes(image)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (url, data, bytearray(data), image):
        loaded = load_image(source)
        assert loaded.mode == "RGB"
        assert same_pixels(loaded, image)


def test_rgba_is_composited_on_white_like_hf_convert_to_rgb(rng: np.random.Generator) -> None:
    from transformers.image_transforms import convert_to_rgb

    for mode in ("RGBA", "L"):
        source = random_image(rng, mode)
        expected = convert_to_rgb(source, return_numpy=True)
        assert np.array_equal(np.asarray(load_image(source)), expected)
        assert np.array_equal(np.asarray(load_image(png_bytes(source))), expected)


@pytest.mark.parametrize(("source", "why"), [
    ("data:image/png;base64,!!!notbase64", "not valid base64"),
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, no image").decode(),
     "not a decodable image"),
    (b"plain text, no image", "not a decodable image"),
    ("ftp://example.com/cat.png", "unsupported URL scheme"),
    ("/etc/hostname", "local files are refused"),
    ("file:///etc/hostname", "local files are refused"),
    (12345, "expected a URL"),
])
def test_bad_sources_raise_value_error_naming_image_url(source: object, why: str) -> None:
    with pytest.raises(ValueError, match="image_url") as info:
        load_image(source)  # type: ignore[arg-type]
    assert why in str(info.value)


def test_truncated_png_is_refused_as_undecodable(image: Image.Image) -> None:
    with pytest.raises(ValueError, match="image_url: not a decodable image"):
        load_image(png_bytes(image)[:60])


def test_bytes_and_data_urls_over_max_bytes_are_refused(image: Image.Image) -> None:
    data = png_bytes(image)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (data, url):
        with pytest.raises(ValueError, match=r"image_url: .*limit"):
            load_image(source, max_bytes=len(data) - 1)
        assert same_pixels(load_image(source, max_bytes=len(data)), image)


def test_local_files_only_under_the_allowed_root(tmp_path: Path, image: Image.Image) -> None:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(png_bytes(image))
    (tmp_path / "secret.png").write_bytes(png_bytes(image))
    allowed = str(root)
    for source in (str(root / "sub" / "cat.png"), (root / "sub" / "cat.png").as_uri(),
                   "file://localhost" + str(root / "sub" / "cat.png"), "sub/cat.png"):
        assert same_pixels(load_image(source, allowed_local_media_path=allowed), image)
    for source in (str(tmp_path / "secret.png"), (tmp_path / "secret.png").as_uri(),
                   str(root / ".." / "secret.png"), "../secret.png"):
        with pytest.raises(ValueError, match="image_url: path is outside the allowed"):
            load_image(source, allowed_local_media_path=allowed)
    with pytest.raises(ValueError, match="image_url: cannot read the local file"):
        load_image(str(root / "missing.png"), allowed_local_media_path=allowed)
    with pytest.raises(ValueError, match="image_url: a file URL must name a local path"):
        load_image("file://otherhost/x.png", allowed_local_media_path=allowed)
    with pytest.raises(ValueError, match=r"image_url: .*limit"):
        load_image("sub/cat.png", allowed_local_media_path=allowed, max_bytes=10)


def test_symlink_escaping_the_root_is_refused(tmp_path: Path, image: Image.Image) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (tmp_path / "secret.png").write_bytes(png_bytes(image))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    (root / "dir").symlink_to(tmp_path, target_is_directory=True)
    for source in (str(root / "link.png"), str(root / "dir" / "secret.png")):
        with pytest.raises(ValueError, match="image_url: path is outside the allowed"):
            load_image(source, allowed_local_media_path=str(root))
    (root / "inside.png").write_bytes(png_bytes(image))
    (root / "alias.png").symlink_to(root / "inside.png")
    assert same_pixels(load_image(str(root / "alias.png"), allowed_local_media_path=str(root)),
                       image)


@pytest.fixture
def http_base(image: Image.Image, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    body = png_bytes(image)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/cat.png":
                self._send(200, body)
            elif self.path == "/no-length.png":  # HTTP/1.0: the body ends when the socket does
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/empty":
                self._send(204, b"")
            elif self.path == "/to-cat":
                self._redirect("/cat.png")
            elif self.path == "/to-ftp":
                self._redirect("ftp://127.0.0.1/cat.png")
            else:
                self._send(404, b"not found")

        def _send(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _redirect(self, location: str) -> None:
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with loopback_http(Handler) as base:
        yield base


def test_http_fetch_ok_404_oversized_and_redirects(http_base: str, image: Image.Image) -> None:
    size = len(png_bytes(image))
    for path in ("/cat.png", "/no-length.png", "/to-cat"):
        assert same_pixels(load_image(http_base + path), image)
    with pytest.raises(ValueError, match="image_url: fetching the URL failed: HTTP 404"):
        load_image(http_base + "/missing.png")
    with pytest.raises(ValueError, match="image_url: fetching the URL answered HTTP 204"):
        load_image(http_base + "/empty")
    with pytest.raises(ValueError, match="image_url: fetching the URL failed: HTTP 302"):
        load_image(http_base + "/to-ftp")
    for path in ("/cat.png", "/no-length.png"):
        with pytest.raises(ValueError, match=f"image_url: image is {size} bytes, over the "
                                             f"{size - 1}-byte limit"):
            load_image(http_base + path, max_bytes=size - 1)


def test_http_network_error_is_a_value_error() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as closed:
        port = closed.server_address[1]
    with pytest.raises(ValueError, match="image_url: fetching the URL failed"):
        load_image(f"http://127.0.0.1:{port}/cat.png", fetch_timeout_s=2.0)
