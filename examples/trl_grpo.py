"""GRPO on grade-school math word problems with a calculator tool, every completion traced.

A script to copy: a small inline dataset (GSM8K-style problems, numeric answers), two reward
functions (the right number, the answer format), one tool, TRL's ``GRPOConfig``, and the one
line that traces it (``tracer.trl.trace``). Run it as it is, then look at what it recorded:

    pip install "rollout-tracer[trl,mlflow]"
    python examples/trl_grpo.py                          # one process
    torchrun --nproc_per_node 2 examples/trl_grpo.py     # two (on CPUs: add --cpu)
    rollout-tracer export --from mlflow --tracking-uri sqlite:///mlflow.db \\
        --experiment trl-gsm8k --out exports/
    rollout-tracer explore exports/

``--model`` is any causal LM whose chat template renders tools (Qwen2.5/Qwen3 instruct models
do; ``--chat-template qwen3`` puts one of TRL's bundled templates on a tokenizer whose own does
not). ``tests/test_trl_modes.py`` runs this file under ``accelerate launch`` (two processes) with a
tiny random model.
"""

from __future__ import annotations

import argparse
import ast
import operator
import re
from pathlib import Path
from typing import Any

# (question, answer): eight to train on, two held out for evaluation
PROBLEMS = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
     "in May. How many clips did Natalia sell altogether in April and May?", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
     "babysitting. How much did she earn?", "10"),
    ("Betty is saving money for a new wallet which costs $100. Betty has only half of the money "
     "she needs. Her parents give her $15, and her grandparents twice as much as her parents. "
     "How much more money does Betty need to buy the wallet?", "5"),
    ("James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
     "write a year?", "624"),
    ("Albert buys 2 large pizzas and 2 small pizzas. A large pizza has 16 slices and a small "
     "pizza has 8 slices. If he eats it all, how many slices does he eat that day?", "48"),
    ("Tina makes $18.00 an hour. How much does she make for 8 hours of work?", "144"),
    ("A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in "
     "total does it take?", "3"),
    ("Mark has a garden with 10 yellow flowers and 80% more purple ones. How many purple "
     "flowers does he have?", "18"),
    ("Ken bought 4 boxes of 12 pencils and gave away 15 pencils. How many pencils are left?", "33"),
    ("A baker bakes 7 trays of 24 rolls and sells 150 rolls. How many rolls are left?", "18"),
]  # fmt: skip
SYSTEM = ("Solve the math problem. You may call the calculator tool for arithmetic. "
          "End your reply with 'Answer: <number>'.")  # fmt: skip
_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "48 / 2 + 48".
    """

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](walk(node.operand)))
        raise ValueError(f"not arithmetic: {expression!r}")

    value = walk(ast.parse(expression, mode="eval").body)  # a SyntaxError is a failed call too
    return str(int(value) if value.is_integer() else round(value, 6))


def _final_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def accuracy(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
    """1 when the number after 'Answer:' is the right one."""
    out: list[float | None] = []
    for completion, truth in zip(completions, answer, strict=True):
        found = re.findall(r"Answer:\s*\$?(-?[\d,]*\.?\d+)", _final_text(completion))
        out.append(float(bool(found) and found[-1].replace(",", "") == truth))
    return out


def answer_format(completions: list[Any], **_: Any) -> list[float | None]:
    """0.2 for ending with 'Answer: <number>', whatever the number."""
    pattern = re.compile(r"Answer:\s*\$?-?[\d,]*\.?\d+\s*$")
    return [0.2 if pattern.search(_final_text(c).strip()) else 0.0 for c in completions]


def _dataset(rows: list[tuple[str, str]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list([
        {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
         "answer": a}
        for q, a in rows
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--chat-template", help="one of TRL's bundled templates, e.g. qwen3")
    p.add_argument("--output-dir", default="trl-gsm8k")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="prompts x generations a process")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (gloo under torchrun)")
    p.add_argument("--backend", default="mlflow", help="tracer backend: mlflow, jsonl, ...")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    p.add_argument("--jsonl-path")
    args = p.parse_args(argv)

    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import tracer.trl

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat_template:
        template = Path(trl.__file__).parent / "chat_templates" / f"{args.chat_template}.jinja"
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, logging_steps=1,
        per_device_train_batch_size=args.batch_size, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, learning_rate=1e-6,
        # evaluation: the held-out problems, 2 completions each, every 10 steps and at the end
        eval_strategy="steps", eval_steps=min(10, args.max_steps), num_generations_eval=2,
        per_device_eval_batch_size=2, save_strategy="no", report_to=[], use_cpu=args.cpu,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model),
        reward_funcs=[accuracy, answer_format], args=config, processing_class=tokenizer,
        train_dataset=_dataset(PROBLEMS[:8]), eval_dataset=_dataset(PROBLEMS[8:]),
        tools=[calculator],
    )  # fmt: skip
    # the one line: every completion (training and evaluation, every process) a trajectory
    options: dict[str, Any] = {"tracking_uri": args.tracking_uri}
    if args.backend == "jsonl":
        options = {"jsonl_path": args.jsonl_path} if args.jsonl_path else {}
    tracer.trl.trace(trainer, backend=args.backend, project_name="trl-gsm8k",
                     experiment_name=Path(args.output_dir).name, **options)  # fmt: skip
    trainer.train()
    trainer.save_state()  # output_dir/trainer_state.json: the logged steps, tracer/* included
    tracer.shutdown()  # in every process: what it traced is stored before it exits
    # then the process group goes, in every process: one left to the interpreter's exit (gloo)
    # can abort it ("terminate called without an active exception", SIGABRT), which failed
    # the launcher once in CI. In transformers 5.23, Trainer.end() is this call
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
