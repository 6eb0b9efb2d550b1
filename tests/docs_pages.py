"""The pages users read (README.md and docs/*.md) and their fenced blocks: what the docs tests check."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def fences(text: str):
    """(language, body) of each fenced block, and the text outside them, read line by line."""
    blocks, outside, current = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), [])
            else:
                blocks.append((current[0], "\n".join(current[1])))
                current = None
        elif current is not None:
            current[1].append(line)
        else:
            outside.append(line)
    return blocks, "\n".join(outside)
