from __future__ import annotations

import json

from kvbaton.client.sse import SSEDecoder, StreamEvent, parse_event


def _decode(lines: list[str]) -> list[str]:
    decoder = SSEDecoder()
    events = [d for d in map(decoder.feed, lines) if d is not None]
    tail = decoder.flush()
    return events + ([tail] if tail is not None else [])


def test_decoder_splits_events_on_blank_lines_and_skips_comments():
    lines = ["data: {\"a\": 1}", "", ": ping", "", "event: message", "data:{\"b\": 2}", "", "data: [DONE]", ""]
    assert _decode(lines) == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_decoder_joins_multi_line_data_and_flushes_an_unterminated_event():
    assert _decode(["data: one", "data: two", "", "data: last"]) == ["one\ntwo", "last"]
    assert _decode(["", "", ": only a comment"]) == []


def test_parse_completion_chat_usage_and_done_chunks():
    completion = {"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]}
    assert parse_event(json.dumps(completion)) == StreamEvent(text="Hel")
    chat = {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}
    assert parse_event(json.dumps(chat)) == StreamEvent(text="lo", finish_reason="stop")
    role_only = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert parse_event(json.dumps(role_only)).text == ""
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    assert parse_event(json.dumps(usage)).usage == {"prompt_tokens": 3, "completion_tokens": 5}
    assert parse_event(" [DONE]").done


def test_parse_reasoning_content_counts_as_text():
    chunk = {"choices": [{"delta": {"content": None, "reasoning_content": "hmm"}}]}
    assert parse_event(json.dumps(chunk)).text == "hmm"


def test_parse_errors_never_raise():
    assert parse_event('{"error": {"message": "out of memory"}}').error == "out of memory"
    assert parse_event('{"error": "plain"}').error == "plain"
    assert "malformed" in parse_event("{not json").error
    assert "malformed" in parse_event("[1, 2]").error


def test_lines_split_only_at_line_feeds() -> None:
    # vLLM sends U+2028 / U+0085 raw inside JSON strings: httpx's iter_lines (like str.splitlines) cut there
    from kvbaton.client.sse import sse_lines

    event = 'data: {"choices":[{"delta":{"content":"a\u2028b\u0085c"}}]}'
    chunks = [event[:20], event[20:] + "\r\n", "\r", "\ndata: [DONE]\n\n"]
    assert list(sse_lines(chunks)) == [event, "", "data: [DONE]", ""]
