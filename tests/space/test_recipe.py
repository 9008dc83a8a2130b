"""Import paths stored with an experiment resolve back to the user's objects."""

import pytest

from tridens.space import RecipeError, import_object


def test_a_script_not_named_py_is_imported(tmp_path):
    # `python search.python` runs fine; export and td.load import the same file afterwards
    script = tmp_path / "search.python"
    script.write_text("WIDTH = 7\n\ndef width():\n    return WIDTH\n")
    fn = import_object({"path": "__main__:width", "file": str(script)}, trust_code=True)  # importing runs it
    assert fn() == 7


def test_a_missing_script_names_the_file(tmp_path):
    with pytest.raises(RecipeError, match="gone.py"):
        import_object({"path": "__main__:width", "file": str(tmp_path / "gone.py")}, trust_code=True)
