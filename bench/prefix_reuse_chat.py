"""Prefix-reuse hit rate and saved prefill tokens on a scripted 10-turn chat.

The chat goes through the real pieces: the Qwen3.6 chat template and tokenizer render every turn from the message
history (the previous answers decoded by the frontend's OutputDecoder, as the server will), and the engine runs on
the CPU runner with a tiny random Qwen of the real vocabulary. Turns 1-4 and 8-10 use preserve_thinking=false (the
closed turn is re-rendered without its reasoning: restore_turn_checkpoint), turns 5-7 preserve_thinking=true
(the response is re-rendered: append_frontier when its text round-trips to the same tokens, else
restore_response_checkpoint). The same chat with --no-prefix-reuse checks the tokens are identical.

    python bench/prefix_reuse_chat.py [--work /tmp/ninfer-chat] [--out bench/results/prefix_reuse_chat.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ninfer.backends.cpu.runner import build_cpu_runner  # noqa: E402
from ninfer.engine.config import EngineConfig  # noqa: E402
from ninfer.engine.engine import Engine  # noqa: E402
from ninfer.engine.request import PreparedPrompt, RequestOptions, StopTokenPolicy  # noqa: E402
from ninfer.frontend.chat import ChatTemplate  # noqa: E402
from ninfer.frontend.output import OutputDecoder  # noqa: E402
from ninfer.frontend.tokenizer import Tokenizer  # noqa: E402
from ninfer.targets.registry import QWEN_27B_PRESETS  # noqa: E402
from tests.support.qwen_tokenizer import FIXTURES, TOKENIZER_CONFIG, build_qwen_tokenizer_json  # noqa: E402
from tests.test_runner_cpu import tiny_qwen  # noqa: E402

STOP_IDS = {248046, 248044}  # <|im_end|>, <|endoftext|>
QUESTIONS = ["What is speculative decoding?", "Why does it need a draft model?", "How is a draft verified?",
             "What happens when a draft is wrong?", "Show the accept rule for sampling.", "Is greedy output exact?",
             "What does MTP stand for?", "How many draft tokens are typical?", "What limits the speed-up?",
             "Summarize everything in one sentence."]


def preserve_thinking(turn: int) -> bool:
    return 5 <= turn <= 7


def run_chat(engine: Engine, template: ChatTemplate, tokenizer: Tokenizer) -> list[dict]:
    think_opener = len(tokenizer.encode("<think>\n"))
    messages: list[dict] = [{"role": "system", "content": "Answer concisely."}]
    turns = []
    for turn, question in enumerate(QUESTIONS, start=1):
        messages.append({"role": "user", "content": question})
        preserve = preserve_thinking(turn)
        text = template.render(messages, add_generation_prompt=True, enable_thinking=True,
                               preserve_thinking=preserve)
        ids = tokenizer.encode(text)
        prompt = PreparedPrompt(token_ids=ids, thinking=True, assistant_boundary=len(ids) - think_opener,
                                prologue_end=len(ids), preserve_thinking=preserve)
        result = engine.submit(prompt, RequestOptions(max_tokens=24), StopTokenPolicy(STOP_IDS)).result(timeout=300)
        decoder = OutputDecoder(tokenizer, thinking=True, stop_ids=STOP_IDS)
        reasoning = content = ""
        for token in result.tokens:
            delta = decoder.push(token)
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            if decoder.finished:
                break
        closing = decoder.finish()
        messages.append({"role": "assistant", "content": content + closing.content,
                         "reasoning_content": reasoning + closing.reasoning})
        turns.append({"turn": turn, "preserve_thinking": preserve, "prompt_tokens": result.usage.prompt_tokens,
                      "cached_tokens": result.usage.cached_tokens, "prefill_tokens": result.usage.prefill_tokens,
                      "path": result.usage.reuse_path, "tokens": list(result.tokens)})
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ninfer-chat"), help="where tokenizer.json is built")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_reuse_chat.json")
    args = parser.parse_args()
    tokenizer = Tokenizer(build_qwen_tokenizer_json(args.work / "tokenizer.json").read_bytes(),
                          TOKENIZER_CONFIG.read_bytes())
    template = ChatTemplate((FIXTURES / "Qwen3.6-27B" / "chat_template.jinja").read_text())
    model = tiny_qwen(vocab=248320, vocab_ids=248077)
    runs = {}
    for reuse in (True, False):
        config = EngineConfig(max_concurrency=2, max_context=4096, prefill_chunk=256, greedy=True,
                              prefix_reuse=reuse)
        with Engine(build_cpu_runner(model, config), config, QWEN_27B_PRESETS) as engine:
            runs[reuse] = run_chat(engine, template, tokenizer)
    turns = runs[True]
    identical = [t["tokens"] for t in turns] == [t["tokens"] for t in runs[False]]
    prompt_tokens = sum(t["prompt_tokens"] for t in turns)
    saved = sum(t["cached_tokens"] for t in turns)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result = {
        "benchmark": "prefix_reuse_chat", "date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip(),
        "turns": len(turns), "hit_rate": sum(t["cached_tokens"] > 0 for t in turns) / len(turns),
        "prompt_tokens": prompt_tokens, "saved_prefill_tokens": saved, "saved_fraction": saved / prompt_tokens,
        "prefill_tokens_with_reuse": sum(t["prefill_tokens"] for t in turns),
        "prefill_tokens_without_reuse": sum(t["prefill_tokens"] for t in runs[False]),
        "tokens_identical_with_reuse_off": identical,
        "per_turn": [{k: v for k, v in t.items() if k != "tokens"} for t in turns],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for t in result["per_turn"]:
        print(f"turn {t['turn']:2d} preserve={t['preserve_thinking']!s:5} prompt {t['prompt_tokens']:4d} "
              f"cached {t['cached_tokens']:4d} {t['path']}")
    print(f"hit rate {result['hit_rate']:.0%}, saved {saved}/{prompt_tokens} prefill tokens "
          f"({result['saved_fraction']:.0%}), identical tokens with reuse off: {identical}")


if __name__ == "__main__":
    main()
