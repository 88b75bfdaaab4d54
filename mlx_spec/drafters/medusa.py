"""Medusa: heads on the target's last hidden state draft the tokens after the next one.

The hidden state of the last verified position gave the target's own next token; head i
applied to it drafts the token i + 1 after that one. Nothing is cached: each step reads the
hidden state the verification pass just computed (a tap on the last layer). A chain takes one
token per head (drawn with the generation's noise when sampling, like any chain drafter); a
tree takes each head's top tokens and keeps the paths of highest probability product up to a
node budget, the DDTree construction (drafters/ddtree.py)."""

from .base import Draft, Drafter
from .ddtree import tree_from_logits


class MedusaDrafter(Drafter):
    shared = ("target", "model")

    def __init__(self, target, model, tree_budget: int = 0, tree_topk: int = 4):
        self.target, self.model = target, model
        self.taps = (target.num_layers - 1,)
        self.tree_budget, self.tree_topk = tree_budget, tree_topk
        self.tree = tree_budget > 0
        self.hidden = None  # the target's last hidden state at the last verified position
        self.position = 0  # of the first draft

    def _keep(self, taps) -> None:
        self.hidden = taps[self.taps[0]][0, -1:]

    def prefill(self, context, taps, start):
        self.hidden = None  # a one-token prompt has no hidden state yet: a plain step
        if taps:
            self._keep(taps)
        self.position = len(context)

    def propose(self, k):
        n = min(k, self.model.args.num_heads)
        if n <= 0 or self.hidden is None:
            return Draft()
        logits = self.model(self.model.fuse(self.hidden), n)[:, 0]  # [n, V]
        positions = range(self.position, self.position + n)
        if self.tree:
            return tree_from_logits(
                logits,
                positions,
                self.sampler,
                self.target.vocab_size,
                self.tree_topk,
                self.tree_budget,
                ids=self.model.draft_ids,
            )
        tokens, q, confidence = self.sampler.draw(
            logits, positions, self.target.vocab_size, ids=self.model.draft_ids
        )
        return Draft(tokens=tokens, q=q, confidence=confidence)

    def chains(self):
        return self.spawn_without_trees()

    def commit(self, accepted, next_token, taps):
        self._keep(taps)
        self.position += len(accepted) + 1
