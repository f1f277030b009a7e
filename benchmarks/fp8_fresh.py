"""Does fp8's tolerance hold on sentences the conversion never saw? The real all-MiniLM-L6-v2 converted as the fp8
section converts it (16 calibration sentences in 4 batches, tolerance 0.02), then its error on each calibration
batch and on 10 batches of new sentences (the section's 8 held-out ones and 32 more).

``python -m benchmarks.fp8_fresh`` prints the search's record (each judged batch's error, the bound it held within
the tolerance) and the error on every fresh batch; ``--judged 1`` judges each trial on the last calibration batch
alone, by its own error: the search before it was judged by a bound on a new batch's error.
"""

from __future__ import annotations

import argparse
import logging

import torch

import amppass
from amppass.fx.runners import fp8 as runner

from . import fp8

MORE = [
    "My sister moved to Berlin last year.", "The bridge was closed for repairs.", "Can you recommend a good book?",
    "Birds migrate south in the autumn.", "The printer is out of paper again.",
    "He scored the winning goal in overtime.", "Fresh bread smells wonderful in the morning.",
    "The senator announced her retirement.", "Why is the sky blue?", "Our flight was delayed by three hours.",
    "The cat knocked a glass off the table.", "Solar panels convert sunlight into electricity.",
    "They painted the fence bright red.", "The library has a new reading room.",
    "I need to buy groceries after work.", "The river flooded the lower town.", "A young boy is flying a kite.",
    "The company hired fifty new engineers.", "Tea is popular in many countries.",
    "The concert was cancelled due to rain.", "She learned to play chess at six.",
    "Mountains were covered in fresh snow.", "The doctor prescribed a week of rest.",
    "Traffic was heavy on the highway.", "The professor explained the theorem slowly.",
    "We watched the sunset from the hill.", "The phone battery died quickly.",
    "A group of tourists visited the castle.", "The team celebrated their victory.",
    "Vegetables grow well in this soil.", "The baby laughed at the puppy.", "The old clock stopped at midnight.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judged", type=int, default=runner.JUDGED, help="calibration batches judging each trial")
    runner.JUDGED = parser.parse_args().judged
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    case = fp8._minilm()
    converted = amppass.convert(case.model, example_kwargs=case.calibration[0], dtype="fp8", plan_for="coverage",
                                calibration=case.calibration, tolerance=fp8.TOLERANCE)
    info = amppass.report(converted).info["fp8"]
    print({key: info.get(key) for key in ("products", "output_error", "error_bound", "margin", "batch_errors")})
    fresh = fp8._sentence_batches(fp8.HELD_OUT + MORE)
    errors = [fp8.held_out_error(converted, fp8.Case(case.name, case.model, [], [batch])) for batch in fresh]
    print("calibration batches:", [round(fp8.held_out_error(converted, fp8.Case(case.name, case.model, [], [b])), 4)
                                   for b in case.calibration])
    print("fresh batches:", [round(e, 4) for e in errors])
    print(f"fresh: largest {max(errors):.4f}, mean {sum(errors) / len(errors):.4f}, "
          f"{sum(e > fp8.TOLERANCE for e in errors)} of {len(errors)} beyond {fp8.TOLERANCE:g}")


if __name__ == "__main__":
    main()
