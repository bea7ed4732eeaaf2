"""The example's reward (TRL's signature): the share of a completion's characters that are lowercase ASCII
letters. A random tiny model writes about one in ten; GRPO teaches it to write more."""


def lowercase(prompts, completions, **columns):
    return [sum("a" <= c <= "z" for c in text) / max(1, len(text)) for text in completions]
