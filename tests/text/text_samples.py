"""Sample texts shared by the text-layer tests."""

# Text that trips up detokenizers: ZWJ emoji sequences, skin tones, flags, CJK, combining
# marks, runs of spaces and newlines, tabs, leading spaces.
TRICKY_TEXTS = [
    "Hello, world!",
    "👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🇯🇵🇫🇷 flags, 🏳️‍🌈 and 🧑🏿‍💻 coder",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "e\u0301 a\u0308 n\u0303 Z\u0351\u0362\u0340a\u0302l\u0323g\u0327o",
    "runs    of     spaces   and\ttabs\t\there",
    "\n\nnew\nlines\n\n\n",
    "   leading spaces",
    " one leading space",
    "trailing spaces   ",
    "mixed: café naïve Ελληνικά русский עברית العربية हिन्दी 🙂",
    "code:\n    def f(x):\n        return x ** 2  # ok\n",
    "numbers 1234567 and 3.14159, $12.50",
]
