"""Token usage picked out of responses for the scheduler's learning."""

from __future__ import annotations

import pytest

from kvroute.server.usage import UsageSniffer, output_tokens_of, usage_of


@pytest.mark.parametrize(("doc", "expected"), [
    ({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 60}}}, (100, 60)),
    ({"usage": {"prompt_tokens": 100, "prompt_tokens_details": None}}, (100, None)),
    ({"type": "message_start", "message": {"usage": {"input_tokens": 40, "cache_read_input_tokens": 60}}},
     (100, 60)),
    ({"usage": {"input_tokens": 10, "cache_creation_input_tokens": 5}}, (15, None)),
    ({"type": "response.completed", "response": {"usage": {"input_tokens": 100,
                                                            "input_tokens_details": {"cached_tokens": 30}}}},
     (100, 30)),
    ({"type": "message_delta", "usage": {"output_tokens": 7}}, (None, None)),
    ({"usage": {"prompt_tokens": -1}}, (None, None)),
    ([1, 2], (None, None)),
])
def test_usage_of_each_api(doc, expected):
    assert usage_of(doc) == expected


@pytest.mark.parametrize(("doc", "expected"), [
    ({"usage": {"prompt_tokens": 100, "completion_tokens": 17}}, 17),
    ({"type": "message_start", "message": {"usage": {"input_tokens": 40, "output_tokens": 1}}}, 1),
    ({"type": "message_delta", "usage": {"output_tokens": 7}}, 7),
    ({"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 9}}}, 9),
    ({"usage": {"completion_tokens": True}}, None),
    ({"usage": {"prompt_tokens": 3}}, None),
    ({"choices": []}, None),
])
def test_output_tokens_of_each_api(doc, expected):
    assert output_tokens_of(doc) == expected


def test_a_stream_keeps_the_last_figures_it_saw():
    sniffer = UsageSniffer(sse=True)
    sniffer.feed(b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                 b'{"input_tokens":12,"cache_read_input_tokens":30,"output_tokens":1}}}\n\n')
    sniffer.feed(b'data: {"choices":[]}\n\ndata: not json "usage"\n\n')
    sniffer.feed(b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":3}}\n\n')
    assert (sniffer.prompt_tokens, sniffer.cached_tokens, sniffer.output_tokens) == (42, 30, 3)


def test_a_plain_body_is_read_from_the_document_the_proxy_parsed():
    sniffer = UsageSniffer(sse=False)
    sniffer.feed(b'{"usage": {"prompt_tokens": 9, "completion_tokens": 2}}')  # pieces are not parsed
    assert sniffer.prompt_tokens is None
    sniffer.take({"usage": {"prompt_tokens": 9, "completion_tokens": 2,
                            "prompt_tokens_details": {"cached_tokens": 4}}})
    assert (sniffer.prompt_tokens, sniffer.cached_tokens, sniffer.output_tokens) == (9, 4, 2)
