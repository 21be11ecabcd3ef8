"""Images through `k3trt serve` with the real `openai` client (tiny engine with the tiny
preset's MoonViT tower): image_url data URLs generate deterministically, local files only under
--allowed-media-dir, and a corrupt image, one over the limit and a remote URL each get a 400 naming
the field while the server goes on serving."""

from __future__ import annotations

import socket

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from runtime_utils import data_url, png  # noqa: E402
from runtime_utils import assert_idle_and_no_leak, one_thread  # noqa: E402

from k3trt.serve import ServeConfig, ServerThread  # noqa: E402

NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _ask(client, *parts, **kw):
    msgs = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the pictures?"}]}]
    return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, seed=0,
                                          extra_body={**NO_THINK, "ignore_eos": True}, **kw)


def test_chat_images_over_http(engine, vision, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(31))
    (tmp_path / "secret.png").write_bytes(png(32))
    cfg = ServeConfig(engine, port=_free_port(), model_name="tiny", allowed_media_dir=media,
                      engine_options={"verify_checksums": False, "max_image_bytes": 20_000})
    with one_thread(), ServerThread(cfg) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        one = [_ask(client, _image(data_url(png(1)))) for _ in range(2)]
        assert one[0].choices[0].message.content == one[1].choices[0].message.content
        assert one[0].usage.completion_tokens == 6
        two = _ask(client, _image(data_url(png(1))), _image(data_url(png(2, 112, 56))))
        # 8 image tokens and its span's begin, "image", content and end tokens
        assert two.usage.prompt_tokens == one[0].usage.prompt_tokens + 8 + 4
        stream = _ask(client, _image(data_url(png(1))), stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            one[0].choices[0].message.content
        first = [_ask(client, _image(data_url(png(i))), logprobs=True).choices[0].logprobs.content[0].logprob
                 for i in (1, 2)]
        assert first[0] != first[1]                 # another image, another distribution
        from_file = _ask(client, _image((media / "cat.png").as_uri()))
        assert from_file.choices[0].message.content == _ask(client, _image(data_url(png(31)))).choices[0].message.content

        bad = [(_image("data:image/png;base64," + "A" * 64), "not an image in a supported format"),
               (_image(data_url(png(3, 400, 400))), "limit of 20000 bytes"),
               (_image("https://example.com/cat.png"), "remote image URLs are not fetched"),
               (_image((tmp_path / "secret.png").as_uri()), "outside the allowed media directory"),
               ({"type": "image_url", "image_url": {}}, "image_url"),
               ({"type": "input_audio", "input_audio": {"data": "x"}}, "text and image_url parts")]
        for part, match in bad:
            with pytest.raises(openai.BadRequestError) as e:
                _ask(client, part)
            assert match in e.value.message and e.value.body["param"].startswith("messages"), e.value.body
            again = _ask(client, _image(data_url(png(1))))          # the server goes on serving
            assert again.choices[0].message.content == one[0].choices[0].message.content
        assert_idle_and_no_leak(s.state.llm)


def test_a_server_without_media_dir_reads_no_files(engine, vision, tmp_path):
    (tmp_path / "cat.png").write_bytes(png(33))
    cfg = ServeConfig(engine, port=_free_port(), model_name="tiny", engine_options={"verify_checksums": False})
    with one_thread(), ServerThread(cfg) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="local files are not served"):
            _ask(client, _image((tmp_path / "cat.png").as_uri()))
        assert _ask(client, _image(data_url(png(33)))).usage.completion_tokens == 6
