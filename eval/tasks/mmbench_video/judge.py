"""The 0-3 judge of MMBench-Video: an OpenAI-compatible chat endpoint (any server speaking /v1/chat/completions,
local ones included; plain urllib, no openai package) or a local model run through mmkv in fp16."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

# The benchmark's rubric (VLMEvalKit's MMBench-Video judge prompt), in our words with the same scale.
SYSTEM = (
    "You are an AI assistant grading a candidate answer against a given correct answer. You will see the "
    "question, the correct 'groundtruth' answer and the candidate answer. Rate from 0 to 3, based only on the "
    "semantic similarity between the groundtruth and the candidate answer, ignoring grammatical differences.\n"
    "0 means no similarity: the candidate answer is entirely incorrect.\n"
    "1 means low similarity: the candidate answer is largely incorrect.\n"
    "2 means high similarity: the candidate answer is largely correct.\n"
    "3 means complete similarity: the candidate answer is entirely correct.\n"
    "Reply with a single integer: 0, 1, 2 or 3."
)
USER = "Question: {question}\nGroundtruth answer: {answer}\nCandidate answer: {prediction}\nYour response: "


def parse_score(text: str) -> int:
    """The first standalone digit 0-3 in the reply, else -1 (a failed judgment, as the benchmark records it)."""
    m = re.search(r"(?<!\d)([0-3])(?!\d)", text or "")
    return int(m.group(1)) if m else -1


def chat_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class EndpointJudge:
    def __init__(self, url: str, model: str, api_key_env: str = "OPENAI_API_KEY", retries: int = 3,
                 timeout: float = 60.0):
        self.url, self.model = chat_url(url), model
        self.api_key = os.environ.get(api_key_env, "")
        self.retries, self.timeout = retries, timeout
        self.name = f"{model} via {self.url}"

    def _post(self, payload: dict) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())["choices"][0]["message"]["content"]

    def judge(self, question: str, answer: str, prediction: str) -> tuple[int, str]:
        payload = {"model": self.model, "temperature": 0, "max_tokens": 16,
                   "messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": USER.format(question=question, answer=answer,
                                                                        prediction=prediction)}]}
        err = ""
        for attempt in range(self.retries):
            try:
                reply = self._post(payload)
                return parse_score(reply), reply
            except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
                err = f"{type(e).__name__}: {e}"
                time.sleep(min(2**attempt, 8) * 0.5)
        return -1, f"judge failed after {self.retries} tries: {err}"


class LocalJudge:
    """A local chat model as judge, loaded through mmkv and run with an fp16 cache, greedy."""

    def __init__(self, name: str):
        import mmkv

        self.lm = mmkv.load_model(name)
        self.engine = mmkv.Engine(self.lm)
        self.synthetic = getattr(self.lm.adapter, "synthetic", None)
        self.name = f"local {name}"

    def judge(self, question: str, answer: str, prediction: str) -> tuple[int, str]:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": USER.format(question=question, answer=answer, prediction=prediction)}]
        reply = self.engine.generate(messages, spec="fp16", max_new_tokens=4, do_sample=False).text[0]
        return parse_score(reply), reply


def make_judge(opts: dict):
    if opts.get("infer_only"):
        return None
    if opts.get("judge_url"):
        if not opts.get("judge_model"):
            raise ValueError("--judge-url needs --judge-model (the model name the endpoint serves)")
        return EndpointJudge(opts["judge_url"], opts["judge_model"], opts.get("judge_key_env") or "OPENAI_API_KEY")
    if opts.get("judge_local"):
        return LocalJudge(opts["judge_local"])
    return None


def judge_label(opts: dict) -> str | None:
    """The judge's name without building it (for tables rebuilt from files)."""
    if opts.get("infer_only"):
        return None
    if opts.get("judge_url"):
        return f"{opts.get('judge_model')} via {chat_url(opts['judge_url'])}"
    if opts.get("judge_local"):
        return f"local {opts['judge_local']}"
    return None
