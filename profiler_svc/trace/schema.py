"""The slice of the Kineto/Chrome trace format that the analyser reads, as msgspec structs.

msgspec decodes straight into these slotted structs and skips every field not named here, which
keeps a million-event trace to a few hundred bytes an event. Argument lists that only a few
detectors need (input shapes, dtypes, strides) stay as raw JSON until asked for.
"""
from typing import Annotated, Optional, Union

import msgspec
from msgspec import Meta, Raw, field

Number = Union[int, float]
# Real kernel names reach ~2 kB; a longer one is hostile, and every detector's regex would read it.
Name = Annotated[str, Meta(max_length=16384)]
EMPTY = Raw()  # absent raw field (msgspec cannot put Raw in a union with None)


class EventArgs(msgspec.Struct, gc=False):
    external_id: Optional[int] = field(name="External id", default=None)
    correlation: Optional[int] = None
    stream: Optional[int] = None
    device: Optional[int] = None
    bytes: Optional[Number] = None
    sequence_number: Optional[int] = field(name="Sequence number", default=None)
    input_dims: Raw = field(name="Input Dims", default=EMPTY)
    input_types: Raw = field(name="Input type", default=EMPTY)
    input_strides: Raw = field(name="Input Strides", default=EMPTY)
    concrete_inputs: Raw = field(name="Concrete Inputs", default=EMPTY)
    # Kineto writes thread/process names in "M" events' args
    name: Optional[Name] = None


class TraceEvent(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: Name = ""
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: Number = 0.0
    dur: Number = 0.0
    args: Optional[EventArgs] = None


# A batch of events: the Chrome "JSON array format", or a slice of Kineto's traceEvents.
ARRAY_DECODER = msgspec.json.Decoder(list[TraceEvent])
# Top-level keys (deviceProperties, distributedInfo, our metadata, ...), traceEvents blanked to [].
TOP_LEVEL_DECODER = msgspec.json.Decoder(dict[str, Raw])
ANY_DECODER = msgspec.json.Decoder()
