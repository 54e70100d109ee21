"""Research-paper text for the long-document QA workload: names, sections, sentence
templates and questions. Slots: ``{method}``, ``{baseline}``, ``{dataset}``, ``{metric}``,
``{task}``, ``{field}``, ``{component}``, ``{num}``, ``{pct}``, ``{author}``, ``{place}``."""

from __future__ import annotations

import random
import re

from kvtier.workload import vocab

_PREFIX = ("Flex", "Sparse", "Deep", "Meta", "Hyper", "Quant", "Neuro", "Graph", "Swift", "Lumen", "Tensor",
           "Cascade", "Prism", "Echo", "Orbit", "Fractal", "Nimbus", "Vector", "Atlas", "Helix")
_SUFFIX = ("Route", "Former", "Net", "Cache", "Mix", "Align", "Fuse", "Scope", "Tune", "Bridge", "Sketch",
           "Lens", "Flow", "Gate", "Pilot", "Forge", "Weave", "Stream", "Shift", "Mind")
TASKS = ("long-context question answering", "protein structure prediction", "traffic forecasting",
         "code completion", "speech recognition in noisy rooms", "legal document retrieval", "crop yield estimation",
         "anomaly detection in power grids", "machine translation for low-resource languages",
         "medical image segmentation", "recommendation for cold-start users", "weather nowcasting",
         "scientific claim verification", "robotic grasp planning", "fraud detection in payments",
         "summarization of meeting transcripts", "molecule property prediction", "music generation")
FIELDS = ("natural language processing", "computer vision", "computational biology", "robotics",
          "information retrieval", "climate science", "systems for machine learning", "finance", "healthcare")
DATASETS = ("WikiQA-Long", "ProteinNet-X", "MetroFlow", "CodeStack", "NoisySpeech-12", "CaseLaw-5k", "AgriSat",
            "GridWatch", "FloresLite", "OrganSeg", "ColdRec", "RadarCast", "SciClaim", "GraspWorld", "PayGuard",
            "MeetSum", "MolBench", "TuneSet", "QASPER-Mini", "NarrativeLong")
METRICS = ("F1", "exact match", "BLEU", "ROUGE-L", "mean absolute error", "AUC", "top-1 accuracy",
           "word error rate", "Dice score", "recall at 10", "perplexity", "latency per query")
COMPONENTS = ("the gating network", "the retrieval index", "the memory bank", "the positional encoding",
              "the contrastive loss", "the curriculum schedule", "the sparse attention mask", "the adapter layers",
              "the calibration step", "the data augmentation pipeline", "the distillation objective",
              "the caching policy", "the tokenizer extension", "the uncertainty head")

SECTIONS = ("Abstract", "Introduction", "Related Work", "Method", "Experimental Setup", "Results", "Ablation Study",
            "Discussion", "Limitations", "Conclusion")

SENTENCES = (
    "We study {task}, a problem of growing importance in {field}.",
    "Existing approaches such as {baseline} struggle when inputs exceed {num} tokens.",
    "We propose {method}, which combines {component} with {component}.",
    "On {dataset}, {method} improves {metric} by {pct} points over {baseline}.",
    "The key insight is that {component} can be shared across {num} related inputs.",
    "Prior work by {author} et al. framed {task} as a ranking problem.",
    "Our training set contains {num} examples collected in {place}.",
    "We train for {num} steps with a batch size of {num} on {num} accelerators.",
    "Removing {component} reduces {metric} by {pct} points, confirming its role.",
    "{method} is {pct} percent faster than {baseline} at equal quality.",
    "A failure case occurs when {component} receives out-of-distribution inputs from {dataset}.",
    "We release code and the {dataset} splits to support future work on {task}.",
    "Compared with {baseline}, {method} needs {pct} percent less memory.",
    "Human raters preferred {method} in {pct} percent of {num} pairwise comparisons.",
    "The effect is strongest for inputs longer than {num} tokens, where {baseline} degrades sharply.",
    "We hypothesize that {component} acts as a regularizer for {task}.",
    "Annotators from {place} labelled {num} additional examples for evaluation.",
    "Table {small} reports {metric} on {dataset} for all methods and seeds.",
    "Our analysis suggests that {metric} alone underestimates the gap between {method} and {baseline}.",
    "Future work could extend {method} to {task} and to other problems in {field}.",
)

QUESTIONS = (
    "What is the main contribution of this paper?",
    "Summarize the {section} section in three sentences.",
    "Which dataset is used to evaluate {method}, and what does it contain?",
    "What {metric} does {method} achieve compared with {baseline}?",
    "What limitations do the authors acknowledge?",
    "How does {method} differ from {baseline}?",
    "Explain the role of {component} in the proposed method.",
    "Write a short peer review of this paper, with one strength and one weakness.",
    "What experiments would you add to strengthen the claims?",
    "List the hyperparameters mentioned in the paper.",
    "Who would benefit most from this work in {field}, and why?",
    "Which result in the paper is the most surprising, and why?",
)

LONGALPACA_PROMPT = ("Below is a paper. Memorize the paper and answer my question after the paper.\n"
                     "The paper begins.\n{doc}\nNow the paper ends.\n{question}")

_SLOT = re.compile(r"\{(\w+)\}")


class PaperFacts:
    """One document's fixed entities, so its sentences and questions agree."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.method = rng.choice(_PREFIX) + rng.choice(_SUFFIX)
        self.baseline = rng.choice(_PREFIX) + rng.choice(_SUFFIX) + "-" + str(rng.randint(1, 9))
        self.task, self.field = rng.choice(TASKS), rng.choice(FIELDS)
        self.dataset, self.metric = rng.choice(DATASETS), rng.choice(METRICS)
        self.title = f"{self.method}: {rng.choice(vocab.ADJECTIVES).capitalize()} Progress on {self.task.title()}"

    def fill(self, template: str) -> str:
        r = self.rng

        def sub(m: re.Match[str]) -> str:
            k = m.group(1)
            if k in ("method", "baseline", "task", "field", "dataset", "metric"):
                # mostly the paper's own entities, sometimes others it cites
                if r.random() < 0.8:
                    return getattr(self, k)
                return {"method": r.choice(_PREFIX) + r.choice(_SUFFIX), "baseline": r.choice(_SUFFIX) + "Base",
                        "task": r.choice(TASKS), "field": r.choice(FIELDS), "dataset": r.choice(DATASETS),
                        "metric": r.choice(METRICS)}[k]
            if k == "component":
                return r.choice(COMPONENTS)
            if k == "num":
                return str(r.choice((r.randint(2, 64), r.randint(100, 9999), 2 ** r.randint(5, 14))))
            if k == "small":
                return str(r.randint(1, 9))
            if k == "pct":
                return f"{r.uniform(0.3, 35.0):.1f}"
            if k == "author":
                return r.choice(vocab.FIRST_NAMES)
            if k == "place":
                return r.choice(vocab.PLACES)
            if k == "section":
                return r.choice(SECTIONS[1:])
            raise KeyError(k)
        text = _SLOT.sub(sub, template)
        return text[:1].upper() + text[1:]

    def paragraphs(self):
        """Endless section-headed text: title, then sections of 3-7 sentences, cycling."""
        yield f"{self.title}\n"
        i = 0
        while True:
            head = SECTIONS[i % len(SECTIONS)] + ("" if i < len(SECTIONS) else f" (part {i // len(SECTIONS) + 1})")
            body = " ".join(self.fill(self.rng.choice(SENTENCES)) for _ in range(self.rng.randint(3, 7)))
            yield f"\n{head}\n{body}\n"
            i += 1
