"""Flag values rewritten in a command line another parser reads (paths made absolute, GGUF files
replaced by their converted directories)."""

from slime_meta.config.command_line import rewrite_flag_values


def test_both_forms_are_rewritten_and_nothing_else():
    argv = ["--a", "x", "--b=y", "--c", "z", "x", "--a=", "--a"]
    out = rewrite_flag_values(argv, {"--a", "--b"}, lambda flag, value: f"{flag}:{value}")
    # '--c z' and the bare 'x' are untouched; an empty '--a=' value is rewritten; a trailing '--a' has no value.
    assert out == ["--a", "--a:x", "--b=--b:y", "--c", "z", "x", "--a=--a:", "--a"]


def test_a_value_that_looks_like_a_flag_is_still_the_value():
    out = rewrite_flag_values(["--a", "--b", "--b", "v"], {"--a", "--b"}, lambda flag, value: value.upper())
    assert out == ["--a", "--B", "--b", "V"]
