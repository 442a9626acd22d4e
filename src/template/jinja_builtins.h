// Built-in filters, tests, methods and globals (the part of jinja2's library that HF chat templates
// use, plus HF's own tojson, raise_exception and strftime_now).
#pragma once

#include <string>

#include "template/jinja_value.h"

namespace dl::jinja {

bool IsKnownFilter(const std::string& name);
bool IsKnownTest(const std::string& name);

// `input | name(args)`.
Value ApplyFilter(const std::string& name, Value input, CallArgs& args, Evaluator& ev);
// `value is name(args)`.
bool ApplyTest(const std::string& name, const Value& value, CallArgs& args, Evaluator& ev);
// `obj.name` for str/dict/list methods (e.g. "abc".startswith, d.items); undefined when `obj` has
// no such method.
Value GetMethod(const Value& obj, const std::string& name);
// Adds range, namespace, dict, raise_exception, strftime_now to `globals` (a dict).
void AddGlobals(Dict& globals);

// Helpers shared with the evaluator.
std::string ToLower(const std::string& s);
// Python's `a < b` for numbers, strings and lists; fails on other types.
bool LessThan(const Value& a, const Value& b);
// Python's iteration: list items, dict keys, string code points; undefined iterates as empty.
std::vector<Value> Iterate(const Value& v);

}  // namespace dl::jinja
