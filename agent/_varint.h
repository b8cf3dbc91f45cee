/* The protobuf wire readers both C extensions use (agent/_wire.c, processors/_native.c): a
 * varint, and a message's next field. */
#ifndef TOKENTRACE_VARINT_H
#define TOKENTRACE_VARINT_H

#include <Python.h>
#include <stdint.h>

/* A varint at data[*pos] (at most 10 bytes, ending before `end`); 0 when malformed. */
static int read_varint(const unsigned char *data, Py_ssize_t end, Py_ssize_t *pos,
                       uint64_t *value) {
    uint64_t result = 0;
    for (int shift = 0; shift < 70 && *pos < end; shift += 7) {
        unsigned char byte = data[(*pos)++];
        result |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) {
            *value = result;
            return 1;
        }
    }
    return 0;
}

#define WIRE_VARINT 0
#define WIRE_I64 1
#define WIRE_LEN 2
#define WIRE_I32 5
#define MAX_FIELD_NUMBER ((1u << 29) - 1)

/* The next field's number and wire type, and its bytes [*start, *stop) (a LEN field's content;
 * a VARINT field's varint, for read_varint); *pos moves past the field. 0 for malformed input
 * or a group (the Python path decides). */
static int next_field(const unsigned char *data, Py_ssize_t end, Py_ssize_t *pos,
                      uint32_t *number, int *wire_type, Py_ssize_t *start, Py_ssize_t *stop) {
    uint64_t tag, length;
    if (!read_varint(data, end, pos, &tag) || (tag >> 3) == 0 || (tag >> 3) > MAX_FIELD_NUMBER) {
        return 0;
    }
    *number = (uint32_t)(tag >> 3);
    *wire_type = (int)(tag & 7);
    switch (*wire_type) {
    case WIRE_VARINT:
        *start = *pos;
        if (!read_varint(data, end, pos, &length)) {
            return 0;
        }
        *stop = *pos;
        return 1;
    case WIRE_I64:
    case WIRE_I32: {
        Py_ssize_t width = *wire_type == WIRE_I64 ? 8 : 4;
        if (end - *pos < width) {
            return 0;
        }
        *start = *pos;
        *pos += width;
        *stop = *pos;
        return 1;
    }
    case WIRE_LEN:
        if (!read_varint(data, end, pos, &length) || length > (uint64_t)(end - *pos)) {
            return 0;
        }
        *start = *pos;
        *pos += (Py_ssize_t)length;
        *stop = *pos;
        return 1;
    default:
        return 0;
    }
}

#endif
