"""The GPT's chat template: a conversation rendered as a play (service/api/openai/chat_template.py)."""

from types import SimpleNamespace

from service.api.openai import chat_template
def message(role, content, name=None):
    return SimpleNamespace(role=role, content=content, name=name)


def test_a_conversation_is_a_scene_and_the_model_speaks_next():
    prompt = chat_template.render([
        message("system", "A street in Verona."),
        message("user", "Good morrow."),
        message("assistant", "Good morrow, cousin."),
        message("user", "What news?", name="BENVOLIO"),
    ])
    assert prompt == ("A street in Verona.\n\nROMEO:\nGood morrow.\n\nJULIET:\nGood morrow, cousin.\n\n"
                      "BENVOLIO:\nWhat news?\n\nJULIET:\n")


def test_blank_lines_inside_a_message_do_not_end_its_turn():
    prompt = chat_template.render([message("user", "  First line.\n\n\n  \nSecond line.  ")])
    assert prompt == "ROMEO:\nFirst line.\nSecond line.\n\nJULIET:\n"
    assert prompt.count(chat_template.END_OF_TURN) == 1


def test_text_parts_are_joined():
    parts = [SimpleNamespace(type="text", text="Wherefore "), SimpleNamespace(type="text", text="art thou?")]
    assert chat_template.render([message("user", parts)]) == "ROMEO:\nWherefore art thou?\n\nJULIET:\n"
