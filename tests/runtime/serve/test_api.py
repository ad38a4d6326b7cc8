"""`ovshard api` against real clients: the official `openai` package, curl, raw HTTP; real workers behind it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from api_server import CLI, Api, api
from conftest import at_once, compile_fp32
from families import moe_with_tokenizer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("api") / "stories", stages=2)


@pytest.fixture(scope="module")
def server(bundle: Path) -> Iterator[Api]:
    with api(bundle, "--streams", "4", "--queue", "8", "--retry-s", "1") as running:
        yield running


def run_text(bundle: Path, tokens: int) -> str:
    """What `ovshard run --local` prints after the prompt, greedy, for the same bundle."""
    out = subprocess.run([*CLI, "-q", "run", str(bundle), "--local", "--exact", "--prompt", PROMPT, "--max-tokens",
                          str(tokens), "--speculative", "off"], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.startswith(PROMPT)
    return out.stdout[len(PROMPT):].rstrip("\n")


def test_models_lists_the_bundle(server: Api) -> None:
    """GET /v1/models names the one model this server serves."""
    assert [m.id for m in server.client.models.list().data] == ["stories"]


def test_greedy_completion_equals_ovshard_run_and_counts_usage(server: Api, bundle: Path) -> None:
    """A greedy completion is `ovshard run`'s text without the prompt; usage counts prompt and new tokens."""
    answer = server.client.completions.create(model="stories", prompt=PROMPT, max_tokens=30, temperature=0)
    assert answer.choices[0].text == run_text(bundle, 30)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (5, 30)


def test_streamed_chat_equals_the_whole_answer(server: Api) -> None:
    """Chat streamed as server-sent events adds up to the non-streamed answer; usage comes last when asked."""
    messages = [{"role": "user", "content": PROMPT}]
    whole = server.client.chat.completions.create(model="stories", messages=messages, max_tokens=25, temperature=0)
    chunks = list(server.client.chat.completions.create(model="stories", messages=messages, max_tokens=25,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text.startswith(", there was")
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 25


def test_seeded_sampling_is_reproducible(server: Api) -> None:
    """The same seed gives the same sampled text; another seed gives another."""
    def sample(seed: int) -> str:
        return server.client.completions.create(model="stories", prompt=PROMPT, max_tokens=30, temperature=1.0,
                                                top_p=0.9, seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_strings_end_the_answer(server: Api) -> None:
    """The answer ends before the first of several stop strings, with finish reason stop."""
    answer = server.client.completions.create(model="stories", prompt=PROMPT, max_tokens=60, temperature=0,
                                              stop=["Lily", "zzz"])
    assert answer.choices[0].text == ", there was a little girl named "
    assert answer.choices[0].finish_reason == "stop"


def alone_and_at_once(client: openai.OpenAI, model: str) -> tuple[list[str], list[str]]:
    """Four prompts' greedy completions asked one after another, then all four at once."""
    prompts = [PROMPT, "The cat", "Lily saw", "One day"]

    def ask(q: str) -> str:
        return client.completions.create(model=model, prompt=q, max_tokens=40, temperature=0).choices[0].text

    return [ask(q) for q in prompts], at_once(ask, prompts, 120)


def test_four_concurrent_requests_each_equal_their_solo_answer(server: Api) -> None:
    """Four clients at once get exactly what each gets alone."""
    solo, together = alone_and_at_once(server.client, "stories")
    assert together == solo


def _batch_totals(url: str) -> tuple[float, float]:
    """/metrics' engine counters: (ticks, sequence rows) since the head connected."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    totals = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return totals["ovshard_batch_ticks_total"], totals["ovshard_batch_sequence_rows_total"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "deepseek_v3", "llama4_text"])
def test_an_moe_bundle_serves_concurrent_requests_batched_each_as_alone(stories: Path, tmp_path: Path,
                                                                        model_type: str) -> None:
    """A 2-stage fp32 MoE bundle (Qwen3-MoE; GLM-4.5's block with a dense first layer and grouped sigmoid routing;
    DeepSeek-V3's with latent attention; Llama 4's with chunked and NoPE layers, which run stateful) behind
    `ovshard api` over stage worker processes: the first answer is what `ovshard run --local` prints, four clients
    at once each get their solo answer, and the engine's ticks carried several sequences (paged: in one
    inference; stateful: one Step a sequence, every stream advanced by one loop)."""
    checkpoint = moe_with_tokenizer(stories, tmp_path / "moe", model_type)
    bundle = compile_fp32(checkpoint, tmp_path / "moe-bundle", stages=2)
    prompts = [PROMPT, "The cat", "Lily saw", "One day"]
    with api(bundle, "--streams", "4") as server:
        def ask(prompt: str) -> str:
            return server.client.completions.create(model="moe-bundle", prompt=prompt, max_tokens=40,
                                                    temperature=0).choices[0].text

        solo = [ask(q) for q in prompts]
        assert solo[0] == run_text(bundle, 40)
        ticks, rows = _batch_totals(server.url)
        assert at_once(ask, prompts) == solo
        more_ticks, more_rows = _batch_totals(server.url)
        assert more_rows - rows > more_ticks - ticks, "no inference carried more than one sequence"


def test_bad_requests_get_openai_shaped_errors(server: Api) -> None:
    """n=2 and logprobs are 400 naming the field, an unknown model is 404, a non-JSON body is 400."""
    with pytest.raises(openai.BadRequestError, match="n=2"):
        server.client.completions.create(model="stories", prompt=PROMPT, n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="gpt-4o", prompt=PROMPT)
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sees_server_sent_event_framing(server: Api) -> None:
    """`curl -N` receives `data: {json}` events separated by blank lines and ending in `data: [DONE]`."""
    body = json.dumps({"model": "stories", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sN", f"{server.url}/v1/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=60, check=True).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == ", there was a little"


def test_metrics_and_health(server: Api) -> None:
    """/metrics parses as Prometheus text with requests, tokens, latencies, stage and hop times, and the
    engine's ticks, rows, KV blocks, prefix lookups and preemptions; /health reports every stage up."""
    from prometheus_client.parser import text_string_to_metric_families

    server.client.completions.create(model="stories", prompt=PROMPT, max_tokens=10, temperature=0)
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ovshard_requests", "ovshard_generated_tokens", "ovshard_time_to_first_token_seconds",
                 "ovshard_inter_token_latency_seconds", "ovshard_stage_compute_seconds", "ovshard_hop_network_seconds",
                 "ovshard_speculative_accepted", "ovshard_queue_depth", "ovshard_active_streams",
                 "ovshard_batch_ticks", "ovshard_batch_rows", "ovshard_batch_sequence_rows", "ovshard_kv_blocks",
                 "ovshard_prefix_lookup_tokens", "ovshard_prefix_hit_tokens", "ovshard_preemptions",
                 "ovshard_batch_last_rows"):
        assert name in families, name
    ticks = [s.value for s in families["ovshard_batch_ticks"].samples if s.name.endswith("_total")]
    rows = [s.value for s in families["ovshard_batch_rows"].samples if s.name.endswith("_total")]
    assert ticks[0] >= 10 and rows[0] >= ticks[0]  # the prompt and every decode step went as Batches
    blocks = {s.labels["state"]: s.value for s in families["ovshard_kv_blocks"].samples}
    assert set(blocks) == {"used", "cached", "free"} and sum(blocks.values()) > 0
    generated = [s.value for s in families["ovshard_generated_tokens"].samples if s.name.endswith("_total")]
    assert generated and generated[0] >= 10
    stages = {s.labels.get("stage") for s in families["ovshard_stage_compute_seconds"].samples}
    assert {"0", "1"} <= stages
    health = json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=30).read())
    assert health["status"] == "ok" and [s["state"] for s in health["stages"]] == ["up", "up"]


def test_a_client_that_disconnects_frees_its_slot(bundle: Path) -> None:
    """With one slot, a streamed request abandoned mid-way is cancelled: the next request is served at once."""
    with api(bundle, "--streams", "1", "--queue", "0") as one:
        stream = one.client.completions.create(model="stories", prompt=PROMPT, max_tokens=480, temperature=0,
                                               stream=True)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                answer = one.client.completions.create(model="stories", prompt=PROMPT, max_tokens=5, temperature=0)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the abandoned request still holds the slot"
                time.sleep(0.1)
        assert answer.choices[0].text == ", there was a little"


def test_busy_is_429_and_a_dead_stage_is_503(bundle: Path) -> None:
    """With one slot and no queue a second request is 429; with a stage gone, requests are 503 naming it and
    /health says which stage is down."""
    with api(bundle, "--streams", "1", "--queue", "0", "--retry-s", "1") as one:
        stream = one.client.completions.create(model="stories", prompt=PROMPT, max_tokens=480, temperature=0,
                                               stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError, match="busy"):
            one.client.completions.create(model="stories", prompt=PROMPT, max_tokens=5)
        stream.close()
        one.workers[1].process.kill()
        one.workers[1].process.wait()
        deadline = time.monotonic() + 20
        with pytest.raises(openai.InternalServerError, match="stage 1 at 127.0.0.1"):
            while time.monotonic() < deadline:  # until the abandoned request has left the slot
                try:
                    one.client.completions.create(model="stories", prompt=PROMPT, max_tokens=5)
                except openai.RateLimitError:
                    time.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{one.url}/health", timeout=30)
        health = json.loads(e.value.read())
        assert e.value.code == 503 and [s["state"] for s in health["stages"]] == ["up", "down"]


def test_an_api_key_is_required_when_given(bundle: Path) -> None:
    """With --api-key, a client without it (or with another) gets 401; with it, an answer; /health and the page
    (static, it asks for the key) stay open, the page's live view /v1/pipeline does not."""
    with api(bundle, "--api-key", "s3cret") as keyed:
        with pytest.raises(openai.AuthenticationError, match="api-key"):
            keyed.client.models.list()
        good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert good.completions.create(model="stories", prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text \
            == ", there was a little"
        assert json.loads(urllib.request.urlopen(f"{keyed.url}/health", timeout=30).read())["status"] == "ok"
        assert b"<title>ovshard</title>" in urllib.request.urlopen(f"{keyed.url}/", timeout=30).read()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{keyed.url}/v1/pipeline", timeout=30)
        assert e.value.code == 401


def test_listening_beyond_loopback_needs_an_api_key(bundle: Path) -> None:
    """`ovshard api --listen 0.0.0.0:0` without --api-key refuses to start, naming --api-key and --insecure."""
    out = subprocess.run([*CLI, "api", str(bundle), "--stages", "127.0.0.1:1,127.0.0.1:2", "--listen", "0.0.0.0:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--api-key" in out.stderr and "--insecure" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["api", "chat"])
def test_a_placement_without_local_is_a_usage_error(bundle: Path, command: str) -> None:
    """--in-process or --workers with --stages (they place --local stages only): exit 2, naming --local."""
    out = subprocess.run([*CLI, command, str(bundle), "--stages", "127.0.0.1:1,127.0.0.1:2", "--workers"],
                         capture_output=True, text=True, timeout=60, input="")
    assert out.returncode == 2 and "--workers choose where --local runs the stages" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Debian's headless chromium through its chromium-driver (installed by .ci/run; never a download); its
    profile and temporary folders go under the test's own temporary folder, not /tmp."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    home = tmp_path_factory.mktemp("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--user-data-dir={home / 'profile'}"):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, env={**os.environ, "TMPDIR": str(home)})
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_web_page_streams_a_chat_answer_and_shows_each_stage(server: Api, browser: object) -> None:
    """The page at / sends a message, streams the greedy answer the openai client gets, and shows one box per
    stage with its address, layers and a measured compute time."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    driver: WebDriver = browser  # type: ignore[assignment]
    expected = server.client.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                                     max_tokens=40, temperature=0).choices[0].message.content
    driver.get(f"{server.url}/")
    WebDriverWait(driver, 30).until(lambda d: "stories" in d.find_element(By.ID, "model").text)
    for field, value in (("temperature", "0"), ("max-tokens", "40")):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "input").send_keys(PROMPT)
    driver.find_element(By.ID, "send").click()
    answer = WebDriverWait(driver, 60).until(
        lambda d: d.find_element(By.CSS_SELECTOR, ".message.assistant[data-state=done]"))
    assert answer.find_element(By.CLASS_NAME, "text").text == expected
    # the live view re-renders the stage table as it polls: read it in one script call, never through
    # element handles the next render makes stale
    def stage_rows() -> list[dict[str, str]]:
        return [{k: v.strip() for k, v in row.items()} for row in driver.execute_script(
            "return [...document.querySelectorAll('.stage')].map(s => ({host: s.querySelector('.host').innerText,"
            " layers: s.querySelector('.layers').innerText, compute: s.querySelector('.compute').innerText}))")]

    rows = WebDriverWait(driver, 30).until(
        lambda _: (r := stage_rows()) and all("-" not in x["compute"] for x in r) and r)
    assert [r["host"] for r in rows] == [w.address for w in server.workers]
    layers = [r["layers"] for r in rows]
    assert layers[0].startswith("layers [0, ") and layers[-1].endswith(", 5) of 5"), layers
    for row in rows:
        compute = row["compute"]
        assert float(compute.split()[0]) > 0, compute
    occupancy = driver.execute_script("return [...document.querySelectorAll('.stage .occupancy')].map(e => e.innerText)")
    assert len(occupancy) == len(rows) and all(o.startswith("batch ") and "KV" in o for o in occupancy), occupancy


def test_a_prompt_seen_before_is_served_from_the_prefix_cache(server: Api) -> None:
    """A chat turn that brings back a conversation the pipeline just served: its usage counts the prompt tokens
    whose KV the stages held already (the prefix cache), and its answer equals the first one."""
    history = [{"role": "user", "content": " ".join([PROMPT] * 8)}]
    first = server.client.chat.completions.create(model="stories", messages=history, max_tokens=12, temperature=0)
    again = server.client.chat.completions.create(model="stories", messages=history, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 32 and cached < again.usage.prompt_tokens


def test_a_one_stage_bundle_is_served_from_the_apis_own_process(stories: Path, tmp_path: Path) -> None:
    """`api --local` on a one-stage bundle runs the stage in its own process (no worker): greedy text equal to
    `ovshard run`'s, concurrent requests each as alone, a repeated history from the prefix cache, /health and
    /v1/pipeline naming the stage in-process; `--workers` starts a worker instead and answers the same."""
    import psutil

    one = compile_fp32(stories, tmp_path / "one", stages=1)
    with api(one, "--exact", local=True) as server:
        assert psutil.Process(server.process.pid).children() == []
        answer = server.client.completions.create(model="one", prompt=PROMPT, max_tokens=30, temperature=0)
        assert answer.choices[0].text == run_text(one, 30)
        solo, together = alone_and_at_once(server.client, "one")
        assert together == solo
        history = [{"role": "user", "content": " ".join([PROMPT] * 8)}]
        first = server.client.chat.completions.create(model="one", messages=history, max_tokens=12, temperature=0)
        again = server.client.chat.completions.create(model="one", messages=history, max_tokens=12, temperature=0)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 32
        health = json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=30).read())
        assert health["status"] == "ok" and [(s["state"], s["address"]) for s in health["stages"]] == \
            [("up", "in-process")]
        view = json.loads(urllib.request.urlopen(f"{server.url}/v1/pipeline", timeout=30).read())
        assert [s["address"] for s in view["stages"]] == ["in-process"]
    with api(one, "--exact", "--workers", local=True) as workers:
        assert len(psutil.Process(workers.process.pid).children()) == 1
        again_text = workers.client.completions.create(model="one", prompt=PROMPT, max_tokens=30, temperature=0)
        assert again_text.choices[0].text == answer.choices[0].text
