"""The faulty proxy (tests/faulty_store.py) in front of a loopback moto S3, driven by s3fs as users run
it (AWS_ENDPOINT_URL at the proxy): unfaulted it is invisible, and each fault does what it models, seen
from s3fs and checked directly against moto. What botocore, aiohttp and s3fs do about each fault is
pinned here too, since remote outputs will lean on it:

- a 503 SlowDown is retried by botocore (legacy mode: 5 attempts in all), then s3fs raises OSError EBUSY;
- a dropped connection on a PUT is sent again once by aiohttp itself (PUT is idempotent to it), inside
  each botocore attempt; after that, botocore's ConnectionClosedError/EndpointConnectionError;
- `pipe_file(mode="create")` sends `If-None-Match: *`, moto answers 412, s3fs raises FileExistsError:
  also when the object is the client's own write whose reply was lost (store.StoreLock reads its
  token back for that reason).
"""

from __future__ import annotations

import http.client
import os

import pytest

from .faulty_store import FaultyProxy, Rule

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")
botocore_exceptions = pytest.importorskip("botocore.exceptions")

BUCKET = "fault-bucket"
# moto checks no signature, but denies a request without one as anonymous
AUTH = {"Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
                         "SignedHeaders=host, Signature=0"}
DROPPED = (botocore_exceptions.ConnectionClosedError, botocore_exceptions.EndpointConnectionError)


@pytest.fixture(scope="module")
def moto_url():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def started(moto_url):
    proxy = FaultyProxy(moto_url).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        yield proxy
    proxy.stop()


@pytest.fixture
def proxy(started):
    """The module's proxy with no rules and zeroed counters."""
    started.clear()
    yield started
    started.clear()


@pytest.fixture
def fs(proxy):
    """s3fs as users run it: found through AWS_ENDPOINT_URL, every default kept."""
    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.fixture
def quick(proxy):
    """s3fs that tries once (botocore one attempt, s3fs one round), to see a fault's own effect."""
    one = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"retries": {"total_max_attempts": 1}})
    one.retries = 1
    return one


@pytest.fixture
def direct(moto_url):
    """moto itself, past the proxy: the truth about what was written."""
    return s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=moto_url, use_listings_cache=False)


def _puts(proxy, key: str) -> list:
    return [s for s in proxy.log if s.method == "PUT" and key in s.path]


def test_rules_pick_by_method_match_every_and_times():
    first_two = Rule("503", method="PUT", match="shard-", times=2)
    picks = [first_two.picks(m, p) for m, p in
             [("GET", "/b/shard-0"), ("PUT", "/b/other"), ("PUT", "/b/shard-0"), ("PUT", "/b/shard-1"),
              ("PUT", "/b/shard-2")]]
    assert picks == [False, False, True, True, False] and first_two.fired == 2
    every_third = Rule("drop_reply", every=3)
    assert [every_third.picks("GET", "/x") for _ in range(7)] == [False, False, True] * 2 + [False]
    with pytest.raises(ValueError):
        FaultyProxy("http://127.0.0.1:1").fail(how="500")


def test_unfaulted_operations_through_the_proxy_equal_direct(fs, direct, proxy, tmp_path):
    local = tmp_path / "a.bin"
    local.write_bytes(os.urandom(300_000))
    big = os.urandom(12 * 2**20)  # over the block size: a multipart upload (POSTs and part PUTs)
    fs.put_file(str(local), f"{BUCKET}/plain/a.bin")
    fs.pipe(f"{BUCKET}/plain/b.txt", b"hello")
    with fs.open(f"{BUCKET}/plain/big.bin", "wb", block_size=5 * 2**20) as f:
        f.write(big)
    assert fs.ls(f"{BUCKET}/plain", detail=False) == direct.ls(f"{BUCKET}/plain", detail=False)
    assert fs.cat(f"{BUCKET}/plain/a.bin") == direct.cat(f"{BUCKET}/plain/a.bin") == local.read_bytes()
    assert fs.cat(f"{BUCKET}/plain/big.bin") == big  # streamed back in 64 KiB pieces
    assert fs.cat_file(f"{BUCKET}/plain/big.bin", start=7, end=70_007) == big[7:70_007]
    fs.invalidate_cache()  # so that info asks the store (HEAD), not the listing
    assert fs.info(f"{BUCKET}/plain/b.txt")["size"] == direct.info(f"{BUCKET}/plain/b.txt")["size"] == 5
    fs.rm_file(f"{BUCKET}/plain/b.txt")  # DeleteObject
    fs.rm(f"{BUCKET}/plain/big.bin")  # DeleteObjects, a POST
    assert direct.ls(f"{BUCKET}/plain", detail=False) == [f"{BUCKET}/plain/a.bin"]
    assert {s.how for s in proxy.log} == {"forward"} and not proxy.fired
    posts = [s.path.split("?")[1].split("=")[0] for s in proxy.log if s.method == "POST"]
    assert posts == ["uploads", "uploadId", "delete"]  # multipart create and complete, delete
    assert any("partNumber=" in s.path for s in _puts(proxy, "big.bin"))
    assert proxy.seen["GET"] >= 3 and proxy.seen["HEAD"] and proxy.seen["DELETE"] == 1


def test_a_chunked_upload_and_keep_alive_pass_through(proxy, direct):
    conn = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=30)
    conn.request("PUT", f"/{BUCKET}/chunked.txt", body=iter([b"abc", b"defg"]), headers=AUTH,
                 encode_chunked=True)
    put = conn.getresponse()
    assert put.status == 200, put.read()
    put.read()
    sock = conn.sock
    conn.request("GET", f"/{BUCKET}/chunked.txt", headers=AUTH)
    got = conn.getresponse()
    assert (got.status, got.read()) == (200, b"abcdefg")
    assert conn.sock is sock  # the same connection served both
    assert proxy.log[0].headers["transfer-encoding"] == "chunked"
    assert direct.cat(f"{BUCKET}/chunked.txt") == b"abcdefg"
    conn.close()


def test_stop_cuts_kept_alive_connections(moto_url):
    proxy = FaultyProxy(moto_url).start()
    conn = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=30)
    conn.request("GET", f"/{BUCKET}", headers=AUTH)
    assert conn.getresponse().read() and proxy.seen["GET"] == 1
    proxy.stop()
    with pytest.raises((http.client.HTTPException, OSError)):
        conn.request("GET", f"/{BUCKET}", headers=AUTH)
        conn.getresponse()
    assert proxy.seen["GET"] == 1
    conn.close()


def test_a_503_is_retried_and_the_write_lands(fs, direct, proxy):
    rule = proxy.fail(method="PUT", match="shard-", times=2, how="503")
    fs.pipe(f"{BUCKET}/slow/shard-0.bin", b"data")
    fs.pipe(f"{BUCKET}/slow/other.bin", b"more")
    assert [s.how for s in _puts(proxy, "shard-0")] == ["503", "503", "forward"]
    # botocore retried (it numbers its attempts), not s3fs around it
    attempts = [s.headers["amz-sdk-request"] for s in _puts(proxy, "shard-0")]
    assert [next(a for a in h.split("; ") if a.startswith("attempt=")) for h in attempts] == [
        "attempt=1", "attempt=2", "attempt=3"]
    assert [s.how for s in _puts(proxy, "other")] == ["forward"]
    assert rule.fired == proxy.fired["503"] == 2
    assert direct.cat(f"{BUCKET}/slow/shard-0.bin") == b"data"


def test_a_dropped_upload_writes_nothing(quick, fs, direct, proxy):
    proxy.fail(method="PUT", match="dropped", how="drop_upload")
    with pytest.raises(DROPPED):
        quick.pipe(f"{BUCKET}/dropped.bin", os.urandom(100_000))
    # aiohttp sent the PUT again once by itself: botocore numbers both its first attempt
    assert [s.headers["amz-sdk-request"] for s in _puts(proxy, "dropped")] == ["attempt=1"] * 2
    assert proxy.fired["drop_upload"] == 2
    assert not direct.exists(f"{BUCKET}/dropped.bin")
    proxy.clear()
    proxy.fail(method="PUT", match="dropped", how="drop_upload", times=1)
    fs.pipe(f"{BUCKET}/dropped.bin", b"second")
    assert [s.how for s in _puts(proxy, "dropped")] == ["drop_upload", "forward"]
    assert direct.cat(f"{BUCKET}/dropped.bin") == b"second"


def test_a_dropped_reply_leaves_the_object_written(quick, direct, proxy):
    proxy.fail(method="PUT", match="unheard", how="drop_reply")
    with pytest.raises(DROPPED):
        quick.pipe(f"{BUCKET}/unheard.bin", b"written")
    assert proxy.fired["drop_reply"] == 2  # both sends reached moto
    assert direct.cat(f"{BUCKET}/unheard.bin") == b"written"


def test_conditional_create_sends_if_none_match_and_moto_answers_412(fs, direct, proxy, moto_url):
    path = f"{BUCKET}/create/one.bin"
    fs.pipe_file(path, b"first", mode="create")
    assert _puts(proxy, "one.bin")[-1].headers.get("if-none-match") == "*"
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert direct.cat(path) == b"first"

    conn = http.client.HTTPConnection(moto_url.removeprefix("http://"), timeout=30)
    conn.request("PUT", f"/{path}", body=b"raw", headers={"If-None-Match": "*", **AUTH})
    answer = conn.getresponse()
    assert answer.status == 412 and b"<Code>PreconditionFailed</Code>" in answer.read()
    conn.close()


def test_a_create_whose_reply_was_lost_meets_its_own_object_as_existing(fs, direct, proxy):
    """The case a retried create must be idempotent for: the write landed, the retry is refused."""
    path = f"{BUCKET}/create/lost-reply.bin"
    proxy.fail(method="PUT", match="lost-reply", how="drop_reply", times=1)
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"mine", mode="create")
    assert [s.how for s in _puts(proxy, "lost-reply")] == ["drop_reply", "forward"]
    assert direct.cat(path) == b"mine"
