"""The synthetic intent-code task: 8 customer-support intents x 8 phrasings = 64 messages, each
labelled with an arbitrary two-character code that has nothing to do with its wording.

The code table exists only in the training pairs, so the seed prompt scores about 0 and an
optimizer succeeds only by moving the table from the data into the prompt (docs/rlmopt.md,
Tasks). `simulated_task_lm` is a deterministic stand-in for a task LM on this task: it knows each
message's intent and answers with the code the prompt assigns to that intent (through a table
line naming the intent, or a worked example of the same intent), else with a fixed wrong guess.
"""
from __future__ import annotations

import re

from rlmopt.lm import FunctionLM
from rlmopt.task import Example, Field, Task

CODES = {
    "refund_request": "K9", "account_locked": "V3", "shipping_delay": "Q7",
    "cancel_subscription": "B2", "change_address": "X4", "damaged_item": "M8",
    "billing_error": "J5", "password_reset": "R6",
}

PHRASINGS = {
    "refund_request": [
        "I would like my money back for this order.", "Can you refund the jacket I returned?",
        "Please send me a refund, the product was not what I expected.",
        "How do I get reimbursed for my purchase?", "I want to return this and get a refund.",
        "Give me my money back please.", "Is it possible to get a refund on last week's order?",
        "I never used the service, I expect a full refund."],
    "account_locked": [
        "My account is locked and I cannot sign in.", "It says my profile has been suspended.",
        "I got locked out after too many attempts.", "Why is my account blocked?",
        "The site will not let me into my account any more, it is frozen.",
        "Please unlock my account.", "I am locked out of my user account.",
        "My login is disabled, can you reactivate it?"],
    "shipping_delay": [
        "My package still has not arrived.", "Where is my order? It is two weeks late.",
        "The delivery was supposed to be yesterday.", "Tracking has not updated in days.",
        "Why is shipping taking so long?", "My parcel is stuck in transit.",
        "The courier missed the delivery date again.", "When will my order finally be delivered?"],
    "cancel_subscription": [
        "Please cancel my subscription.", "I want to stop my monthly plan.",
        "How do I end my membership?", "Do not renew my plan next month.",
        "Cancel the recurring payment for my subscription.", "I would like to unsubscribe from the service.",
        "Terminate my premium plan please.", "Stop charging me for the subscription, I am leaving."],
    "change_address": [
        "I moved, please update my shipping address.", "Can I change the delivery address on my order?",
        "My address is wrong in your system.", "Send it to my new apartment instead.",
        "I need to edit the address on my account.", "Please use a different street address.",
        "Update my postal address to the new one.", "The order should go to my office address now."],
    "damaged_item": [
        "The item arrived broken.", "My order came with a cracked screen.",
        "The box was crushed and the vase inside is shattered.", "The product is damaged.",
        "One of the parts was bent when it arrived.", "It came scratched and dented.",
        "The glass was smashed on delivery.", "The chair I received has a broken leg."],
    "billing_error": [
        "I was charged twice for the same order.", "There is a wrong amount on my invoice.",
        "You billed me for something I did not buy.", "My card was overcharged.",
        "The price on my bill does not match the checkout.", "Why is there an extra fee on my statement?",
        "I see a duplicate payment on my card.", "The invoice total is incorrect."],
    "password_reset": [
        "I forgot my password.", "How do I reset my password?", "The password reset email never came.",
        "I need a new password for my account.", "My password does not work any more, help me change it.",
        "Send me a link to reset my password.", "I cannot remember my login password.",
        "Can you help me set a new password?"],
}

SEED_PROMPT = ("Read the customer's message and answer with the right two-character code. "
               "Answer with the code alone.")


def intent_of(message: str) -> str | None:
    for intent, phrasings in PHRASINGS.items():
        if message in phrasings:
            return intent
    return None


def build() -> Task:
    """The 64-example task (ids m00..m63 in a fixed interleaved order: phrasing-major)."""
    examples = []
    intents = list(PHRASINGS)
    for k in range(8):
        for j, intent in enumerate(intents):
            idx = k * 8 + j
            examples.append(Example(f"m{idx:02d}", {"message": PHRASINGS[intent][k]},
                                    {"code": CODES[intent]}))
    return Task(
        name="intent_code",
        description=("Map a customer-support message to a two-character code. Each of eight "
                     "intents (refund, locked account, late shipping, cancellation, address change, "
                     "damaged item, billing error, password reset) has an arbitrary code; the "
                     "table is not given, but the training examples show it. Output field `code`, "
                     "scored by exact match."),
        examples=examples, fields=[Field("code", "exact_match")],
        seed_candidate={"system_prompt": SEED_PROMPT}, max_tokens=8)


_WORDS = {intent: intent.split("_") for intent in CODES}


def _simulate(prompt: str) -> str:
    message = prompt.rsplit("message:", 1)[-1].strip()
    intent = intent_of(message)
    if intent is None:
        return "ZZ"
    body = prompt.rsplit("message:", 1)[0]
    # a worked example of the same intent (other than this message) teaches its code
    for demo_msg, code in re.findall(r"message: (.+)\nOutput: (\S+)", body):
        if demo_msg.strip() != message and intent_of(demo_msg.strip()) == intent:
            return code.strip()
    # a table line naming the intent, e.g. "refund_request -> K9" or "refund request: K9"
    for line in body.splitlines():
        low = line.lower().replace("_", " ")
        if all(w in low for w in _WORDS[intent]):
            m = re.search(r"\b([A-Z][0-9])\b", line)
            if m:
                return m.group(1)
    return "ZZ"


def simulated_task_lm() -> FunctionLM:
    """A deterministic task LM for this task (see the module docstring)."""
    return FunctionLM(_simulate)
