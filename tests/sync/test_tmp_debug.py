import asyncio, subprocess
from pathlib import Path
from test_bus import Node, KEY
from sync_helpers import wait_until
from kvroute.sync.local_redis import LocalRedis, free_port

async def test_dbg(tmp_path: Path) -> None:
    tls_port = free_port()
    r = LocalRedis(password="pw", extra_args=("--tls-port", str(tls_port), "--tls-cert-file", "/tmp/kvs/cert.pem", "--tls-key-file", "/tmp/kvs/key.pem", "--tls-auth-clients", "no"))
    r.start()
    url = f"rediss://:pw@127.0.0.1:{tls_port}/0?ssl_ca_certs=/tmp/kvs/cert.pem"
    a = await Node(url).start()
    home = a.route()
    b = await Node(url).start()
    await wait_until(lambda: a.bus.unsent == 0 and b.matched() > 0, what="facts over TLS")
    for n in (a, b):
        st = asyncio.create_task(n.bus.stop())
        await asyncio.sleep(2)
        if not st.done():
            for t in asyncio.all_tasks():
                t.print_stack(limit=30)
            assert False
    r.close()
