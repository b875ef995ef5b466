"""LangChain integration of zml: ``ChatZML`` routes chat requests across an inference fleet.

::

    from langchain_zml import ChatZML

    llm = ChatZML(model="meta-llama/llama-3-8b-instruct", policy="llama3-production")
    llm.invoke("Hello").response_metadata["zml_routing"]
"""

from langchain_zml.chat_models import ChatZML

__all__ = ["ChatZML"]
