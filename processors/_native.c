/* The collector's per-token work in C: token-offset arrays read from their wire bytes and the
 * inter-token gaps derived from them. Every request runs both over its ~160 offsets, which in
 * Python costs ~20 µs a request even with C builtins doing the loops (a list per step). And the
 * request span's attributes read from the span's bytes as received (a protobuf wrapper object
 * per attribute and per value cost ~6 µs a span in Python).
 *
 * Each function has a Python twin that gives the same answers (tokentrace.processors.native);
 * these return None where the input leaves the fast path (the twin then answers), never raise
 * for odd input, and the tests compare the two on generated input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../agent/_varint.h"

#define NS_PER_US 1000

/* array.array, for the int64 arrays ('q') these functions answer with: one buffer per request
 * instead of a Python int per token (set when the module is made). */
static PyObject *array_type;

/* A new array('q') of values[0..count). */
static PyObject *int64_array(const int64_t *values, Py_ssize_t count) {
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)values, count * (Py_ssize_t)8);
    if (bytes == NULL) {
        return NULL;
    }
    PyObject *result = PyObject_CallFunction(array_type, "sO", "q", bytes); /* frombytes */
    Py_DECREF(bytes);
    return result;
}

/* A growing buffer of int64s (PyMem; values NULL until the first append). */
typedef struct {
    int64_t *values;
    Py_ssize_t count, capacity;
} Int64s;

static int int64s_append(Int64s *list, int64_t value) {
    if (list->count == list->capacity) {
        Py_ssize_t capacity = list->capacity ? 2 * list->capacity : 64;
        int64_t *grown = PyMem_Realloc(list->values, sizeof(int64_t) * (size_t)capacity);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        list->values = grown, list->capacity = capacity;
    }
    list->values[list->count++] = value;
    return 0;
}

/* The buffer as a new array('q'), freed. */
static PyObject *int64s_finish(Int64s *list) {
    PyObject *result = int64_array(list->values, list->count);
    PyMem_Free(list->values);
    list->values = NULL;
    return result;
}

/* int_values(serialised ArrayValue, count) -> array('q') | None
 *
 * The int_value of every element when there are `count` elements and each is exactly an
 * AnyValue holding an int_value (field 1, length-delimited: tag 0x18 and one varint, nothing
 * else); None otherwise.
 */
static PyObject *int_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "int_values takes 2 arguments");
        return NULL;
    }
    PyObject *arg = args[0];
    Py_ssize_t expected = PyLong_AsSsize_t(args[1]);
    if (expected == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyBytes_Check(arg)) {
        Py_RETURN_NONE;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(arg);
    Py_ssize_t size = PyBytes_GET_SIZE(arg);
    /* An element takes at least 4 bytes (0x0a, its length, 0x18, a varint). */
    if (expected < 0 || expected > size / 4 + 1) {
        Py_RETURN_NONE;
    }
    int64_t *values = PyMem_Malloc(sizeof(int64_t) * (size_t)(expected ? expected : 1));
    if (values == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t pos = 0, index = 0;
    while (pos < size) {
        uint64_t length, value;
        if (index == expected || data[pos++] != 0x0A || !read_varint(data, size, &pos, &length) ||
            length > (uint64_t)(size - pos) || length < 2 || data[pos] != 0x18) {
            goto not_exact;
        }
        Py_ssize_t element_end = pos + (Py_ssize_t)length;
        pos++;
        if (!read_varint(data, element_end, &pos, &value) || pos != element_end) {
            goto not_exact;
        }
        values[index++] = (int64_t)value;
    }
    if (index != expected) {
        goto not_exact;
    }
    PyObject *result = int64_array(values, expected);
    PyMem_Free(values);
    return result;
not_exact:
    PyMem_Free(values);
    Py_RETURN_NONE;
}

static int64_t *int64_buffer(PyObject *values, Py_ssize_t *count);

/* gaps_ns(offsets_us: list[int] | array('q')) -> array('q') | None
 *
 * The differences between consecutive offsets (µs) in ns, in order; negative ones and those
 * past 64 bits in ns left out (malformed offsets); None when an offset is not an int that fits
 * 64 bits.
 */
static PyObject *gaps_ns(PyObject *module, PyObject *arg) {
    (void)module;
    Py_ssize_t count;
    int64_t *offsets = int64_buffer(arg, &count);
    if (offsets == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    Py_ssize_t kept = 0; /* written over the offsets, each after it was read */
    for (Py_ssize_t index = 1; index < count; index++) {
        int64_t gap, gap_ns;
        if (!__builtin_sub_overflow(offsets[index], offsets[index - 1], &gap) &&
            !__builtin_mul_overflow(gap, (int64_t)NS_PER_US, &gap_ns) && gap_ns >= 0) {
            offsets[kept++] = gap_ns;
        }
    }
    PyObject *result = int64_array(offsets, kept);
    PyMem_Free(offsets);
    return result;
}

/* An int that fits 64 bits as an int64: 1, or 0 (no exception) for anything else. */
static int int64_of(PyObject *item, int64_t *value) {
    if (!PyLong_Check(item)) {
        return 0;
    }
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (number == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *value = number;
    return 1;
}

/* Reads a list of ints, or an int64 buffer (array('q')), into a new int64 buffer; NULL (no
 * exception) when `values` is neither or a list element is not an int that fits 64 bits, NULL
 * with MemoryError set when out of memory. */
static int64_t *int64_buffer(PyObject *values, Py_ssize_t *count) {
    int64_t *buffer;
    if (!PyList_Check(values)) {
        Py_buffer view;
        if (!PyObject_CheckBuffer(values) ||
            PyObject_GetBuffer(values, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            return NULL;
        }
        if (view.itemsize != 8 || view.format == NULL ||
            (strcmp(view.format, "q") != 0 && strcmp(view.format, "l") != 0)) {
            PyBuffer_Release(&view);
            return NULL;
        }
        *count = view.len / 8;
        buffer = PyMem_Malloc(sizeof(int64_t) * (size_t)(*count ? *count : 1));
        if (buffer == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(buffer, view.buf, sizeof(int64_t) * (size_t)*count);
        PyBuffer_Release(&view);
        return buffer;
    }
    *count = PyList_GET_SIZE(values);
    buffer = PyMem_Malloc(sizeof(int64_t) * (size_t)(*count ? *count : 1));
    if (buffer == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t index = 0; index < *count; index++) {
        if (!int64_of(PyList_GET_ITEM(values, index), &buffer[index])) {
            PyMem_Free(buffer);
            return NULL;
        }
    }
    return buffer;
}

/* The k-th smallest of values[0..count) (0-based), reordering them so that every value before
 * position k is <= it (Hoare's selection, expected linear time). */
static int64_t select_kth(int64_t *values, Py_ssize_t count, Py_ssize_t k) {
    Py_ssize_t low = 0, high = count - 1;
    while (low < high) {
        int64_t pivot = values[low + (high - low) / 2];
        Py_ssize_t left = low, right = high;
        while (left <= right) {
            while (values[left] < pivot) left++;
            while (values[right] > pivot) right--;
            if (left <= right) {
                int64_t swap = values[left];
                values[left++] = values[right];
                values[right--] = swap;
            }
        }
        if (k <= right) {
            high = right;
        } else if (k >= left) {
            low = left;
        } else {
            break; /* between the partitions: equal to the pivot */
        }
    }
    return values[k];
}

/* gap_median(gaps_ns: list[int], min_gaps: int) -> tuple[float | None, int] | None
 *
 * The median of the non-negative gaps (None below `min_gaps` of them; the mean of the two
 * middle ones for an even count) and the largest non-negative gap (-1 when none); None when a
 * gap is not an int that fits 64 bits or two middle gaps sum past 2**53 (a float would round).
 */
static PyObject *gap_median(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "gap_median takes 2 arguments");
        return NULL;
    }
    Py_ssize_t min_gaps = PyLong_AsSsize_t(args[1]);
    if (min_gaps == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t count;
    int64_t *gaps = int64_buffer(args[0], &count);
    if (gaps == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    Py_ssize_t kept = 0;
    int64_t highest = -1;
    for (Py_ssize_t index = 0; index < count; index++) {
        if (gaps[index] >= 0) {
            highest = gaps[index] > highest ? gaps[index] : highest;
            gaps[kept++] = gaps[index];
        }
    }
    PyObject *median;
    if (kept < min_gaps || kept == 0) {
        median = Py_NewRef(Py_None);
    } else {
        Py_ssize_t middle = kept / 2;
        int64_t upper = select_kth(gaps, kept, middle);
        if (kept % 2) {
            median = PyFloat_FromDouble((double)upper);
        } else {
            int64_t lower = gaps[0];
            for (Py_ssize_t index = 1; index < middle; index++) {
                lower = gaps[index] > lower ? gaps[index] : lower;
            }
            if (upper > (INT64_C(1) << 53) - lower) {
                PyMem_Free(gaps);
                Py_RETURN_NONE;
            }
            median = PyFloat_FromDouble((double)(lower + upper) / 2.0);
        }
    }
    PyMem_Free(gaps);
    if (median == NULL) {
        return NULL;
    }
    PyObject *answer = Py_BuildValue("(NL)", median, (long long)highest);
    return answer;
}

#define COUNTING_WIDTH (1 << 16)

static int append_key_count(PyObject *keys, PyObject *counts, int64_t key, Py_ssize_t times) {
    PyObject *key_object = PyLong_FromLongLong(key);
    PyObject *times_object = PyLong_FromSsize_t(times);
    int failed = key_object == NULL || times_object == NULL ||
                 PyList_Append(keys, key_object) < 0 || PyList_Append(counts, times_object) < 0;
    Py_XDECREF(key_object);
    Py_XDECREF(times_object);
    return failed ? -1 : 0;
}

static int compare_int64(const void *left, const void *right) {
    int64_t a = *(const int64_t *)left, b = *(const int64_t *)right;
    return (a > b) - (a < b);
}

/* count_keys_ns(durations_ns: list[int], multiplier: float)
 *     -> tuple[list[int], list[int], int, int, int] | None
 *
 * The distinct sketch keys, ascending, of durations in ns taken as seconds, with how many
 * durations have each: the key of d is ceil(log2(d / 1e9) * multiplier), the same IEEE
 * operations as math.log2 and math.ceil in Python; then the smallest and largest duration and
 * their exact sum. None unless there is a duration and every one is an int in (0, 2**53)
 * (exact as a float) and the sum fits 64 bits.
 */
static PyObject *count_keys_ns(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "count_keys_ns takes 2 arguments");
        return NULL;
    }
    double multiplier = PyFloat_AsDouble(args[1]);
    if (multiplier == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t count;
    int64_t *keys = int64_buffer(args[0], &count);
    if (keys == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    int64_t lowest = INT64_MAX, highest = INT64_MIN;
    int64_t shortest = INT64_MAX, longest = 0, total = 0;
    for (Py_ssize_t index = 0; index < count; index++) {
        int64_t duration = keys[index];
        if (duration <= 0 || duration >= (INT64_C(1) << 53) ||
            __builtin_add_overflow(total, duration, &total)) {
            PyMem_Free(keys);
            Py_RETURN_NONE;
        }
        shortest = duration < shortest ? duration : shortest;
        longest = duration > longest ? duration : longest;
        int64_t key = (int64_t)ceil(log2((double)duration / 1e9) * multiplier);
        keys[index] = key;
        lowest = key < lowest ? key : lowest;
        highest = key > highest ? key : highest;
    }
    if (count == 0) {
        PyMem_Free(keys);
        Py_RETURN_NONE;
    }
    PyObject *distinct = PyList_New(0), *counts = PyList_New(0);
    if (distinct == NULL || counts == NULL) {
        goto failed;
    }
    if (highest - lowest < COUNTING_WIDTH) {
        /* Keys of one request or one slice span a few hundred values: count them in place. */
        Py_ssize_t width = (Py_ssize_t)(highest - lowest) + 1;
        Py_ssize_t *tally = PyMem_Calloc((size_t)width, sizeof(Py_ssize_t));
        if (tally == NULL) {
            PyErr_NoMemory();
            goto failed;
        }
        for (Py_ssize_t index = 0; index < count; index++) {
            tally[keys[index] - lowest]++;
        }
        for (Py_ssize_t slot = 0; slot < width; slot++) {
            if (tally[slot] && append_key_count(distinct, counts, lowest + slot, tally[slot]) < 0) {
                PyMem_Free(tally);
                goto failed;
            }
        }
        PyMem_Free(tally);
    } else {
        qsort(keys, (size_t)count, sizeof(int64_t), compare_int64);
        for (Py_ssize_t start = 0, stop; start < count; start = stop) {
            for (stop = start + 1; stop < count && keys[stop] == keys[start]; stop++) {
            }
            if (append_key_count(distinct, counts, keys[start], stop - start) < 0) {
                goto failed;
            }
        }
    }
    PyMem_Free(keys);
    return Py_BuildValue("(NNLLL)", distinct, counts, (long long)shortest, (long long)longest,
                         (long long)total);
failed:
    PyMem_Free(keys);
    Py_XDECREF(distinct);
    Py_XDECREF(counts);
    return NULL;
}

/* outlier_positions(gaps_ns: list[int], threshold_ns: int) -> list[int] | None
 *
 * The 1-based positions of the gaps longer than threshold_ns, in order (decode_split's outlier
 * gaps: gap i lies between tokens i - 1 and i). None unless every gap and the threshold fit
 * int64.
 */
static PyObject *outlier_positions(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "outlier_positions takes 2 arguments");
        return NULL;
    }
    int64_t threshold;
    if (!int64_of(args[1], &threshold)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count;
    int64_t *gaps = int64_buffer(args[0], &count);
    if (gaps == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *positions = PyList_New(0);
    for (Py_ssize_t index = 0; positions != NULL && index < count; index++) {
        if (gaps[index] > threshold) {
            PyObject *position = PyLong_FromSsize_t(index + 1);
            if (position == NULL || PyList_Append(positions, position) < 0) {
                Py_CLEAR(positions);
            }
            Py_XDECREF(position);
        }
    }
    PyMem_Free(gaps);
    return positions;
}

/* outlier_gap_parts(gaps_ns, offsets_us, first_token, median_rounded, threshold_floor, steps,
 *                   preempted, with_prefill) -> list[tuple[int, int, int, int, int]] | None
 *
 * decode_split.gap_parts with outliers_only, past its median: each gap above threshold_floor
 * (its outlier gaps, in token order) as (gap, decode, interference, stall, preempted) ns.
 * `steps`: the request's (start, stop, prefill tokens) engine steps; `preempted`: its sorted
 * (start, end) preemptions; `with_prefill`: the agent's count of outlier gaps whose steps
 * prefilled, used without steps (0 for none). None where the twin must answer: a negative count,
 * inputs that are not int64 buffers of matching lengths or lists of tuples of int64s, arithmetic
 * past 64 bits, or a step coverage past 2**53 (where the twin's float comparison rounds). */

#define GAP_DECODE 0
#define GAP_INTERFERENCE 1
#define GAP_STALL 2
#define EXACT_LIMIT (((int64_t)1) << 53)
#define GAP_OUTSIDE (-1)

typedef struct {
    int64_t gap, preempted, excess;
    int cause;
} OutlierGap;

/* A list of `width`-tuples of int64s as a flat array: 1, 0 outside (or error set). */
static int int_rows(PyObject *list, Py_ssize_t width, int64_t **rows, Py_ssize_t *count) {
    *rows = NULL;
    *count = 0;
    if (!PyList_Check(list)) {
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    int64_t *out = PyMem_Malloc(sizeof(int64_t) * (size_t)(n * width + 1));
    if (out == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(list, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width) {
            PyMem_Free(out);
            return 0;
        }
        for (Py_ssize_t j = 0; j < width; j++) {
            if (!int64_of(PyTuple_GET_ITEM(row, j), &out[i * width + j])) {
                PyMem_Free(out);
                return 0;
            }
        }
    }
    *rows = out;
    *count = n;
    return 1;
}

/* ns of [begin, end) the sorted preemptions cover (the twin's _overlap); *ok 0 on overflow. */
static int64_t preempted_overlap(const int64_t *intervals, Py_ssize_t count, int64_t begin,
                                 int64_t end, int *ok) {
    int64_t covered = 0, cursor = begin;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t start = intervals[2 * i], stop = intervals[2 * i + 1], part;
        if (start >= end) {
            break;
        }
        int64_t low = start > cursor ? start : cursor;
        int64_t high = stop < end ? stop : end;
        if (high > low) {
            if (__builtin_sub_overflow(high, low, &part) ||
                __builtin_add_overflow(covered, part, &covered)) {
                *ok = 0;
                return 0;
            }
            cursor = high;
        }
    }
    return covered;
}

/* What the steps inside the gap say of its excess (the twin's _excess_cause), or GAP_OUTSIDE. */
static int excess_cause(const int64_t *steps, Py_ssize_t count, int64_t begin, int64_t end) {
    int64_t covered = 0, overlap;
    int with_prefill = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t start = steps[3 * i], stop = steps[3 * i + 1];
        if (__builtin_sub_overflow(stop < end ? stop : end, start > begin ? start : begin,
                                   &overlap)) {
            return GAP_OUTSIDE;
        }
        if (overlap > 0) {
            if (__builtin_add_overflow(covered, overlap, &covered)) {
                return GAP_OUTSIDE;
            }
            with_prefill = with_prefill || steps[3 * i + 2] > 0;
        }
    }
    if (with_prefill) {
        return GAP_INTERFERENCE;
    }
    if (covered >= EXACT_LIMIT || end - begin >= EXACT_LIMIT) {
        return GAP_OUTSIDE; /* the twin compares an int with a rounded float there */
    }
    return (double)covered < 0.5 * (double)(end - begin) ? GAP_STALL : GAP_DECODE;
}

/* One outlier gap (index i) placed and split: 1, or 0 when the twin must answer. */
static int outlier_gap(int64_t gap, int64_t offset_us, int64_t first_token, int64_t median,
                       const int64_t *steps, Py_ssize_t step_count, const int64_t *preempted,
                       Py_ssize_t preempted_count, OutlierGap *part) {
    int64_t begin, end, excess;
    int ok = 1;
    if (__builtin_mul_overflow(offset_us, (int64_t)1000, &begin) ||
        __builtin_add_overflow(begin, first_token, &begin) ||
        __builtin_add_overflow(begin, gap, &end)) {
        return 0;
    }
    int64_t overlap =
        preempted_count ? preempted_overlap(preempted, preempted_count, begin, end, &ok) : 0;
    int64_t preempted_ns = overlap < gap ? overlap : gap;
    if (!ok || __builtin_sub_overflow(gap, median, &excess) ||
        __builtin_sub_overflow(excess, preempted_ns, &excess)) {
        return 0;
    }
    excess = excess > 0 ? excess : 0;
    int cause = excess && step_count ? excess_cause(steps, step_count, begin, end) : GAP_DECODE;
    if (cause == GAP_OUTSIDE) {
        return 0;
    }
    *part = (OutlierGap){gap, preempted_ns, excess, cause};
    return 1;
}

/* Without steps, the `with_prefill` largest gaps with an excess are interference (equal ones in
 * token order), as the twin's sort of (-gap, position) takes them. */
static void mark_largest(OutlierGap *found, Py_ssize_t count, int64_t with_prefill) {
    for (int64_t marked = 0; marked < with_prefill; marked++) {
        Py_ssize_t best = -1;
        for (Py_ssize_t j = 0; j < count; j++) {
            if (found[j].excess && found[j].cause != GAP_INTERFERENCE &&
                (best < 0 || found[j].gap > found[best].gap)) {
                best = j;
            }
        }
        if (best < 0) {
            return;
        }
        found[best].cause = GAP_INTERFERENCE;
    }
}

static PyObject *outlier_gap_parts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "outlier_gap_parts takes 8 arguments");
        return NULL;
    }
    int64_t scalars[4]; /* first_token, median_rounded, threshold_floor, with_prefill */
    for (int i = 0; i < 4; i++) {
        if (!int64_of(args[i == 3 ? 7 : i + 2], &scalars[i])) {
            Py_RETURN_NONE;
        }
    }
    Py_ssize_t gap_count, offset_count = 0, step_count = 0, preempted_count = 0, kept = 0;
    int64_t *gaps = int64_buffer(args[0], &gap_count);
    int64_t *offsets = gaps == NULL ? NULL : int64_buffer(args[1], &offset_count);
    int64_t *steps = NULL, *preempted = NULL;
    OutlierGap *found = NULL;
    PyObject *result = NULL;
    int fast = scalars[3] >= 0 && offsets != NULL && offset_count == gap_count + 1 &&
               int_rows(args[5], 3, &steps, &step_count) &&
               int_rows(args[6], 2, &preempted, &preempted_count) &&
               (found = PyMem_Malloc(sizeof(OutlierGap) * (size_t)(gap_count + 1))) != NULL;
    for (Py_ssize_t i = 0; fast && i < gap_count; i++) {
        if (gaps[i] > scalars[2] && gaps[i] >= 0) {
            fast = outlier_gap(gaps[i], offsets[i], scalars[0], scalars[1], steps, step_count,
                               preempted, preempted_count, &found[kept++]);
        }
    }
    if (fast) {
        if (!step_count && scalars[3] > 0) {
            mark_largest(found, kept, scalars[3]);
        }
        result = PyList_New(kept);
        for (Py_ssize_t j = 0; result != NULL && j < kept; j++) {
            OutlierGap *part = &found[j];
            long long interference = part->cause == GAP_INTERFERENCE ? part->excess : 0;
            long long stall = part->cause == GAP_STALL ? part->excess : 0;
            /* decode = gap - preempted - interference - stall: within [0, gap], no overflow */
            PyObject *row = Py_BuildValue("(LLLLL)", (long long)part->gap,
                                          (long long)(part->gap - part->preempted) - interference -
                                              stall,
                                          interference, stall, (long long)part->preempted);
            if (row == NULL) {
                Py_CLEAR(result);
            } else {
                PyList_SET_ITEM(result, j, row);
            }
        }
    } else if (found == NULL && gaps != NULL && offsets != NULL && offset_count == gap_count + 1 &&
               steps != NULL && preempted != NULL && !PyErr_Occurred()) {
        PyErr_NoMemory(); /* the one allocation that failed without saying so */
    }
    PyMem_Free(gaps);
    PyMem_Free(offsets);
    PyMem_Free(steps);
    PyMem_Free(preempted);
    PyMem_Free(found);
    if (result == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return result;
}

/* --- span attributes read ------------------------------------------------------------------ */

#define SPAN_ENTRY_TAG 0x12 /* ScopeSpans.spans = 2: SpanRef.wire's head */
#define SPAN_ATTRIBUTES 9
#define ANY_STRING 1
#define ANY_BOOL 2
#define ANY_INT 3
#define ANY_DOUBLE 4
#define ANY_ARRAY 5
#define ANY_KVLIST 6
#define ANY_BYTES 7

/* The wire type the protobuf parser expects for AnyValue field `number` (-1: not a field of it,
 * an unknown field to the parser, as is a known one with another wire type). */
static int any_value_wire_type(uint32_t number) {
    switch (number) {
    case ANY_STRING:
    case ANY_ARRAY:
    case ANY_KVLIST:
    case ANY_BYTES:
        return WIRE_LEN;
    case ANY_BOOL:
    case ANY_INT:
        return WIRE_VARINT;
    case ANY_DOUBLE:
        return WIRE_I64;
    default:
        return -1;
    }
}

#define PLAIN_ELEMENT 0   /* an array's element: an array in it is `other` */
#define PLAIN_TOP 1       /* an attribute's value */
#define PLAIN_INT_ARRAY 2 /* an attribute's value read as span_attributes.int_array reads it */

static int plain_value(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop, int mode,
                       PyObject *other, PyObject **out);

/* The int elements of the ArrayValue [start, stop) as an array('q') (span_attributes.int_array:
 * other elements left out), in *out; the return value as plain_value's. An element that is
 * exactly an int_value (tag 0x18 and a varint) is read in place, any other as plain_value reads
 * it: no Python int per token offset. */
static int int_elements(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                        PyObject *other, PyObject **out) {
    Int64s elements = {NULL, 0, 0};
    Py_ssize_t pos = start, field_start = 0, field_stop = 0;
    while (pos < stop) {
        uint32_t number;
        int wire_type;
        if (!next_field(data, stop, &pos, &number, &wire_type, &field_start, &field_stop)) {
            PyMem_Free(elements.values);
            return 0;
        }
        if (number != 1 || wire_type != WIRE_LEN) { /* ArrayValue.values = 1 */
            continue;
        }
        uint64_t varint;
        Py_ssize_t varint_pos = field_start + 1;
        if (field_stop - field_start >= 2 && data[field_start] == 0x18 &&
            read_varint(data, field_stop, &varint_pos, &varint) && varint_pos == field_stop) {
            if (int64s_append(&elements, (int64_t)varint) < 0) {
                PyMem_Free(elements.values);
                return -1;
            }
            continue;
        }
        PyObject *element;
        int read = plain_value(data, field_start, field_stop, PLAIN_ELEMENT, other, &element);
        if (read <= 0) {
            PyMem_Free(elements.values);
            return read;
        }
        int appended = 0;
        if (PyLong_CheckExact(element)) { /* from a varint read as int64: it fits */
            appended = int64s_append(&elements, PyLong_AsLongLong(element));
        }
        Py_DECREF(element);
        if (appended < 0) {
            PyMem_Free(elements.values);
            return -1;
        }
    }
    *out = int64s_finish(&elements);
    return *out == NULL ? -1 : 1;
}

/* The AnyValue [start, stop) as span_attributes.plain_value reads it (PLAIN_TOP) or as it reads
 * an array's element (PLAIN_ELEMENT): a str, bool, int, float, a list of the elements (at the
 * top), or `other`; or (PLAIN_INT_ARRAY) an array('q') of an array's int elements, empty for
 * any other value. 1 with *out a new reference; 0 where the parser's rules for repeated fields
 * would decide (a oneof field set twice) or a string is not UTF-8 (the Python path answers
 * then); -1 on error. */
static int plain_value(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop, int mode,
                       PyObject *other, PyObject **out) {
    Py_ssize_t pos = start, field_start = 0, field_stop = 0, chosen_start = 0, chosen_stop = 0;
    uint32_t chosen = 0;
    while (pos < stop) {
        uint32_t number;
        int wire_type;
        if (!next_field(data, stop, &pos, &number, &wire_type, &field_start, &field_stop)) {
            return 0;
        }
        if (any_value_wire_type(number) != wire_type) {
            continue;
        }
        if (chosen) {
            return 0;
        }
        chosen = number, chosen_start = field_start, chosen_stop = field_stop;
    }
    if (mode == PLAIN_INT_ARRAY && chosen != ANY_ARRAY) {
        *out = int64_array(NULL, 0);
        return *out == NULL ? -1 : 1;
    }
    const char *bytes = (const char *)data + chosen_start;
    uint64_t varint = 0;
    Py_ssize_t varint_pos = chosen_start;
    switch (chosen) {
    case ANY_STRING:
        *out = PyUnicode_DecodeUTF8(bytes, chosen_stop - chosen_start, NULL);
        if (*out == NULL) {
            PyErr_Clear();
            return 0;
        }
        return 1;
    case ANY_BOOL:
    case ANY_INT:
        read_varint(data, chosen_stop, &varint_pos, &varint); /* checked by next_field */
        *out = chosen == ANY_BOOL ? PyBool_FromLong(varint != 0)
                                  : PyLong_FromLongLong((long long)(int64_t)varint);
        return *out == NULL ? -1 : 1;
    case ANY_DOUBLE: {
        uint64_t word = 0;
        double number;
        for (int i = 7; i >= 0; i--) {
            word = word << 8 | data[chosen_start + i];
        }
        memcpy(&number, &word, sizeof number);
        *out = PyFloat_FromDouble(number);
        return *out == NULL ? -1 : 1;
    }
    case ANY_ARRAY:
        if (mode != PLAIN_ELEMENT) {
            break; /* read below */
        }
        Py_INCREF(other); /* an array inside an array */
        *out = other;
        return 1;
    default:
        Py_INCREF(other);
        *out = other;
        return 1;
    }
    if (mode == PLAIN_INT_ARRAY) {
        return int_elements(data, chosen_start, chosen_stop, other, out);
    }
    PyObject *elements = PyList_New(0);
    if (elements == NULL) {
        return -1;
    }
    pos = chosen_start;
    while (pos < chosen_stop) {
        uint32_t number;
        int wire_type;
        if (!next_field(data, chosen_stop, &pos, &number, &wire_type, &field_start, &field_stop)) {
            Py_DECREF(elements);
            return 0;
        }
        if (number != 1 || wire_type != WIRE_LEN) { /* ArrayValue.values = 1 */
            continue;
        }
        PyObject *element;
        int read = plain_value(data, field_start, field_stop, PLAIN_ELEMENT, other, &element);
        if (read <= 0) {
            Py_DECREF(elements);
            return read;
        }
        int appended = PyList_Append(elements, element);
        Py_DECREF(element);
        if (appended < 0) {
            Py_DECREF(elements);
            return -1;
        }
    }
    *out = elements;
    return 1;
}

#define KEY_CACHE_SLOTS 1024 /* a power of two */
#define KEY_CACHE_MAX_BYTES 128

/* The attribute keys read last, by a hash of their bytes (one per slot, the newest winning): keys
 * repeat from span to span, and a cached one costs neither a decode nor, in the dict lookups
 * that follow, a hash (a str keeps its hash). Bounded: 1024 keys of at most 128 bytes. Touched
 * only with the GIL held. */
static PyObject *key_cache[KEY_CACHE_SLOTS];

/* The str of the UTF-8 bytes [bytes, bytes + length) as a new reference, from key_cache where it
 * is there; NULL with no error set where they are not UTF-8 (or the decode failed). */
static PyObject *cached_key(const char *bytes, Py_ssize_t length) {
    PyObject **slot = NULL;
    if (length <= KEY_CACHE_MAX_BYTES) {
        uint64_t hash = 14695981039346656037ULL; /* FNV-1a */
        for (Py_ssize_t i = 0; i < length; i++) {
            hash = (hash ^ (unsigned char)bytes[i]) * 1099511628211ULL;
        }
        slot = &key_cache[hash & (KEY_CACHE_SLOTS - 1)];
        if (*slot != NULL) {
            Py_ssize_t cached_length;
            const char *cached = PyUnicode_AsUTF8AndSize(*slot, &cached_length);
            if (cached != NULL && cached_length == length && memcmp(cached, bytes, length) == 0) {
                Py_INCREF(*slot);
                return *slot;
            }
            PyErr_Clear();
        }
    }
    PyObject *key = PyUnicode_DecodeUTF8(bytes, length, NULL);
    if (key == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (slot != NULL) {
        Py_INCREF(key);
        Py_XSETREF(*slot, key);
    }
    return key;
}

/* The key of the KeyValue [start, stop) as a new str: NULL with no error set where the parser's
 * answer is not this one (a key given twice) or the key is not UTF-8; NULL with an error set on
 * failure. */
static PyObject *key_of(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                        Py_ssize_t *value_start, Py_ssize_t *value_stop, int *values) {
    Py_ssize_t inner = start, key_start = 0, key_stop = 0;
    int keys = 0;
    *values = 0;
    while (inner < stop) {
        uint32_t number;
        int wire_type;
        Py_ssize_t field_start = 0, field_stop = 0;
        if (!next_field(data, stop, &inner, &number, &wire_type, &field_start, &field_stop)) {
            return NULL;
        }
        if (wire_type == WIRE_LEN && number == 1) {
            keys++, key_start = field_start, key_stop = field_stop;
        } else if (wire_type == WIRE_LEN && number == 2) {
            (*values)++, *value_start = field_start, *value_stop = field_stop;
        }
    }
    if (keys > 1 || *values > 1) {
        return NULL;
    }
    return cached_key((const char *)data + key_start, key_stop - key_start);
}

/* The span's bytes [*pos, *size) inside a ScopeSpans.spans entry (tag, length, span); 0 when
 * `entry` is not one. */
static int span_of_entry(PyObject *entry, const unsigned char **data, Py_ssize_t *pos,
                         Py_ssize_t *size) {
    if (!PyBytes_Check(entry)) {
        return 0;
    }
    uint64_t length;
    *data = (const unsigned char *)PyBytes_AS_STRING(entry);
    *size = PyBytes_GET_SIZE(entry);
    *pos = 1;
    return *size >= 1 && (*data)[0] == SPAN_ENTRY_TAG && read_varint(*data, *size, pos, &length) &&
           length == (uint64_t)(*size - *pos);
}

#define LEFT_TO_PYTHON 2

/* The span's next attribute from *pos (the span's bytes end at `size`): 1 with its key (a new
 * reference) and its value's bytes (`values`: 0 when it has none); 0 past the last attribute;
 * LEFT_TO_PYTHON where the parsed span must answer (malformed, a field the parser merges, a key
 * that is not UTF-8); -1 on error. */
static int next_attribute(const unsigned char *data, Py_ssize_t size, Py_ssize_t *pos,
                          PyObject **key, Py_ssize_t *value_start, Py_ssize_t *value_stop,
                          int *values) {
    while (*pos < size) {
        uint32_t number;
        int wire_type;
        Py_ssize_t start = 0, stop = 0;
        if (!next_field(data, size, pos, &number, &wire_type, &start, &stop)) {
            return LEFT_TO_PYTHON;
        }
        if (number != SPAN_ATTRIBUTES || wire_type != WIRE_LEN) {
            continue;
        }
        *key = key_of(data, start, stop, value_start, value_stop, values);
        if (*key == NULL) {
            return PyErr_Occurred() ? -1 : LEFT_TO_PYTHON;
        }
        return 1;
    }
    return 0;
}

/* has_attribute_key(entry: bytes, keys: frozenset[str], prefixes: tuple[str, ...]) -> bool | None
 *
 * Whether an attribute of the span (a ScopeSpans.spans entry, as attribute_slots takes) has a
 * key in `keys` or starting with one of `prefixes`; None where attribute_slots would be. */
static PyObject *has_attribute_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyAnySet_Check(args[1]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "has_attribute_key takes (bytes, frozenset, tuple)");
        return NULL;
    }
    const unsigned char *data;
    Py_ssize_t pos, size;
    if (!span_of_entry(args[0], &data, &pos, &size)) {
        Py_RETURN_NONE;
    }
    PyObject *key;
    Py_ssize_t value_start = 0, value_stop = 0;
    int values, next;
    while ((next = next_attribute(data, size, &pos, &key, &value_start, &value_stop, &values)) ==
           1) {
        int found = PySet_Contains(args[1], key);
        for (Py_ssize_t i = 0; found == 0 && i < PyTuple_GET_SIZE(args[2]); i++) {
            found = (int)PyUnicode_Tailmatch(key, PyTuple_GET_ITEM(args[2], i), 0,
                                             PY_SSIZE_T_MAX, -1);
        }
        Py_DECREF(key);
        if (found != 0) {
            if (found < 0) {
                return NULL;
            }
            Py_RETURN_TRUE;
        }
    }
    if (next < 0) {
        return NULL;
    }
    if (next == LEFT_TO_PYTHON) {
        Py_RETURN_NONE;
    }
    Py_RETURN_FALSE;
}

/* attribute_slots(entry: bytes, slot_of: dict[str, int], slot_count: int, other: object)
 *     -> list[object] | None
 *
 * A list of slot_count values, None where no attribute of the span fills the slot: the span is
 * a ScopeSpans.spans entry (SpanRef.wire: tag, length, the span's bytes), and every attribute
 * whose key slot_of maps to a slot puts its plain value there (span_attributes.plain_value;
 * `other` when the attribute has no value), the last one of a key winning, as the parser
 * lists them; the slots in `int_arrays` (optional, a frozenset) take their value as
 * span_attributes.int_array reads it. None for a malformed entry, a key or value field given
 * twice in one attribute (the parser merges those), or what plain_value leaves to Python.
 */
static PyObject *attribute_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs < 4 || nargs > 5 || !PyDict_Check(args[1]) ||
        (nargs == 5 && !PyAnySet_Check(args[4]))) {
        PyErr_SetString(PyExc_TypeError,
                        "attribute_slots takes (bytes, dict, int, object[, frozenset])");
        return NULL;
    }
    PyObject *slot_of = args[1], *other = args[3], *int_arrays = nargs == 5 ? args[4] : NULL;
    Py_ssize_t slot_count = PyLong_AsSsize_t(args[2]);
    if (slot_count < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "attribute_slots: a negative slot count");
        }
        return NULL;
    }
    const unsigned char *data;
    Py_ssize_t pos, size;
    if (!span_of_entry(args[0], &data, &pos, &size)) {
        Py_RETURN_NONE;
    }
    PyObject *slots = PyList_New(slot_count);
    if (slots == NULL) {
        return NULL;
    }
    for (Py_ssize_t slot = 0; slot < slot_count; slot++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(slots, slot, Py_None);
    }
    PyObject *key;
    Py_ssize_t value_start = 0, value_stop = 0;
    int values, next;
    while ((next = next_attribute(data, size, &pos, &key, &value_start, &value_stop, &values)) ==
           1) {
        PyObject *slot_number = PyDict_GetItemWithError(slot_of, key); /* borrowed */
        Py_DECREF(key);
        if (slot_number == NULL) {
            if (PyErr_Occurred()) {
                goto failed;
            }
            continue;
        }
        Py_ssize_t slot = PyLong_AsSsize_t(slot_number);
        if (slot < 0 || slot >= slot_count) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "attribute_slots: a slot out of range");
            }
            goto failed;
        }
        int mode = int_arrays == NULL ? 0 : PySet_Contains(int_arrays, slot_number);
        if (mode < 0) {
            goto failed;
        }
        mode = mode ? PLAIN_INT_ARRAY : PLAIN_TOP;
        PyObject *value = other;
        if (values) {
            int read = plain_value(data, value_start, value_stop, mode, other, &value);
            if (read == 0) {
                goto outside;
            }
            if (read < 0) {
                goto failed;
            }
        } else if (mode == PLAIN_INT_ARRAY) {
            value = int64_array(NULL, 0);
            if (value == NULL) {
                goto failed;
            }
        } else {
            Py_INCREF(other);
        }
        PyList_SetItem(slots, slot, value); /* steals value, releases the earlier one */
    }
    if (next < 0) {
        goto failed;
    }
    if (next == LEFT_TO_PYTHON) {
        goto outside;
    }
    return slots;
outside:
    Py_DECREF(slots);
    Py_RETURN_NONE;
failed:
    Py_DECREF(slots);
    return NULL;
}

static PyMethodDef native_methods[] = {
    {"outlier_gap_parts", (PyCFunction)(void (*)(void))outlier_gap_parts, METH_FASTCALL,
     "outlier_gap_parts(gaps_ns, offsets_us, first_token, median_rounded, threshold_floor, "
     "steps, preempted, with_prefill) -> list[tuple[int, int, int, int, int]] | None"},
    {"int_values", (PyCFunction)(void (*)(void))int_values, METH_FASTCALL,
     "int_values(serialised_array: bytes, count: int) -> list[int] | None"},
    {"gaps_ns", gaps_ns, METH_O, "gaps_ns(offsets_us: list[int]) -> list[int] | None"},
    {"gap_median", (PyCFunction)(void (*)(void))gap_median, METH_FASTCALL,
     "gap_median(gaps_ns: list[int], min_gaps: int) -> tuple[float | None, int] | None"},
    {"count_keys_ns", (PyCFunction)(void (*)(void))count_keys_ns, METH_FASTCALL,
     "count_keys_ns(durations_ns: list[int], multiplier: float)"
     " -> tuple[list[int], list[int], int, int, int] | None"},
    {"outlier_positions", (PyCFunction)(void (*)(void))outlier_positions, METH_FASTCALL,
     "outlier_positions(gaps_ns: list[int], threshold_ns: int) -> list[int] | None"},
    {"attribute_slots", (PyCFunction)(void (*)(void))attribute_slots, METH_FASTCALL,
     "attribute_slots(entry: bytes, slot_of: dict[str, int], slot_count: int, other: object,"
     " int_arrays: frozenset[int] = ...) -> list[object] | None"},
    {"has_attribute_key", (PyCFunction)(void (*)(void))has_attribute_key, METH_FASTCALL,
     "has_attribute_key(entry: bytes, keys: frozenset[str], prefixes: tuple[str, ...])"
     " -> bool | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "tokentrace's per-token work in C (see native.py).", -1,
    native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (array_type == NULL) {
        PyObject *array_module = PyImport_ImportModule("array");
        if (array_module == NULL) {
            return NULL;
        }
        array_type = PyObject_GetAttrString(array_module, "array");
        Py_DECREF(array_module);
        if (array_type == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&native_module);
}
