"""Pinned hashes of the routing key: the canonical prompt bytes, their block-hash chain, the derived
conversation id and the session key.

Router instances exchange block and session hashes through Redis, and they persist; a change in
how a request is rendered or hashed would make instances of two versions (or one instance before
and after a restart) disagree silently.  These values were computed before the hot path was
rebuilt; any rewrite of parsing or hashing must reproduce them.
"""

from __future__ import annotations

import pytest
import xxhash
from test_request_parsing import grown

from kvroute.api.requests import parse_request
from kvroute.routing.config import RoutingConfig
from kvroute.routing.hashing import block_hashes, token_block_hashes
from kvroute.routing.scheduler import Scheduler, session_hash

# route -> (canonical bytes' length, xxh3_64 of them, est tokens, derived session id,
#           last of the 64-byte block chain, session key)
PINNED = {
    "chat": (266, "2ac3703b12e347ce", 1090, "conv:870bd27de7ad8c1783c1dbbf603221aa",
             0x197C36DCFEFCF87C, 0x42B0615E3D2B957B),
    "messages": (189, "b03065cd1d567dc1", 47, "conv:77bab018a8beaa6693e2d2aae2ad8435",
                 0x1C0A56053791A493, 0xD2EDB3A4589649FE),
    "responses": (221, "53807280e61cc9f3", 55, "conv:1e7480309eee9dbffab783722134b270",
                  0xCFCB7E65D3E40896, 0xA2BCA080515D4378),
}


@pytest.mark.parametrize("route", sorted(PINNED))
def test_routing_keys_hash_as_they_always_did(route: str) -> None:
    length, digest, est, conv, last, session = PINNED[route]
    k = parse_request(route, grown(route)[1], {})
    assert (len(k.prefix), xxhash.xxh3_64_hexdigest(k.prefix)) == (length, digest)
    assert (k.est_prompt_tokens, k.session_id) == (est, conv)
    assert block_hashes(k.cache_scope, k.prefix, 64, 1 << 30)[-1] == last
    assert session_hash(k) == session


def test_completions_prompt_bytes_are_pinned() -> None:
    k = parse_request("completions", grown("completions")[1], {})
    assert (len(k.prefix), xxhash.xxh3_64_hexdigest(k.prefix), k.session_id) == (34, "9e51439ebadec37f", None)


def _long_chat() -> dict[str, object]:
    words = " ".join(f"w{(i * 7919) % 10_000}" for i in range(8000))
    return {"model": "m", "cache_salt": "tenant-a", "messages": [
        {"role": "system", "content": words[:16_000]},
        {"role": "user", "content": [{"type": "text", "text": words[16_000:32_000]},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}


def test_a_32_kb_prompt_hashes_as_it_always_did() -> None:
    k = parse_request("chat", _long_chat(), {"x-session-id": "s-1"})
    hashes = Scheduler(RoutingConfig()).hashes(k)
    assert (len(k.prefix), k.est_prompt_tokens, len(hashes)) == (32_053, 9037, 62)
    assert (hashes[0], hashes[31], hashes[-1]) == (0x6FE07F2AE0D1CD56, 0x87E4387597691C8C, 0x75288DED6DAE7D97)
    assert session_hash(k) == 0x09854E27318EBD6F


def test_token_chains_are_pinned() -> None:
    assert token_block_hashes(list(range(40)), 16)[-1] == 0x0E90949127FCBB52
    assert token_block_hashes(list(range(40)), 16, 12345, [None, b"lora"])[-1] == 0x38C825E75E845406
