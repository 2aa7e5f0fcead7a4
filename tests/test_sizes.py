import pytest

from kvstore import SizeError, format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("10", 10),
     (" 2 kib ", 2048), ("0", 0), (123, 123), ("1TiB", 2**40)],
)
def test_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 GiBs", "abc", "-1GiB", "", -5, 1.5, True, None])
def test_parse_rejects(bad):
    with pytest.raises(SizeError):
        parse_size(bad, what="cpu_capacity")


def test_format():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(4 * 2**30) == "4.0 GiB"
