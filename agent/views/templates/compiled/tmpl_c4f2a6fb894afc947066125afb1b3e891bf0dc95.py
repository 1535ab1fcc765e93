from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = 'report.html'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_csp = resolve('csp')
    l_0_tl = resolve('tl')
    l_0_style = resolve('style')
    l_0_trigger_css = resolve('trigger_css')
    l_0_job_verdict = resolve('job_verdict')
    l_0_verdict = resolve('verdict')
    l_0_ranks = resolve('ranks')
    l_0_summary = resolve('summary')
    l_0_has_history = resolve('has_history')
    l_0_server = resolve('server')
    l_0_capture = resolve('capture')
    l_0_actions = resolve('actions')
    l_0_stacks = resolve('stacks')
    l_0_coredumps = resolve('coredumps')
    l_0_profiles = resolve('profiles')
    l_0_show_requests = resolve('show_requests')
    l_0_requests = resolve('requests')
    l_0_artifacts = resolve('artifacts')
    l_0_spans = resolve('spans')
    l_0_span_files = resolve('span_files')
    l_0_footer = resolve('footer')
    l_0_outcome = l_0_chart = missing
    try:
        t_1 = environment.filters['length']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'length' found.")
    try:
        t_2 = environment.tests['defined']
    except KeyError:
        @internalcode
        def t_2(*unused):
            raise TemplateRuntimeError("No test named 'defined' found.")
    try:
        t_3 = environment.tests['none']
    except KeyError:
        @internalcode
        def t_3(*unused):
            raise TemplateRuntimeError("No test named 'none' found.")
    pass
    def macro(l_1_value, l_1_css):
        t_4 = []
        if l_1_value is missing:
            l_1_value = undefined("parameter 'value' was not provided", name='value')
        if l_1_css is missing:
            l_1_css = undefined("parameter 'css' was not provided", name='css')
        pass
        t_4.extend((
            '<span class="outcome ',
            escape(l_1_css),
            '">',
            escape(l_1_value),
            '</span>',
        ))
        return concat(t_4)
    context.exported_vars.add('outcome')
    context.vars['outcome'] = l_0_outcome = Macro(environment, macro, 'outcome', ('value', 'css'), False, False, False, context.eval_ctx.autoescape)
    def macro(l_1_c):
        t_5 = []
        if l_1_c is missing:
            l_1_c = undefined("parameter 'c' was not provided", name='c')
        pass
        t_5.extend((
            '<svg class="timeline" id="',
            escape(environment.getattr(l_1_c, 'id')),
            '" role="img" aria-label="',
            escape(environment.getattr(l_1_c, 'label')),
            '" width="',
            escape(environment.getattr(l_1_c, 'width')),
            '" height="',
            escape(environment.getattr(l_1_c, 'height')),
            '" viewBox="0 0 ',
            escape(environment.getattr(l_1_c, 'width')),
            ' ',
            escape(environment.getattr(l_1_c, 'height')),
            '">',
        ))
        for l_2_t in environment.getattr(l_1_c, 'ticks'):
            _loop_vars = {}
            pass
            t_5.extend((
                '<line class="tick" x1="',
                escape(environment.getattr(l_2_t, 'x')),
                '" y1="',
                escape((environment.getattr(l_1_c, 'axis_y') - 6)),
                '" x2="',
                escape(environment.getattr(l_2_t, 'x')),
                '" y2="',
                escape((environment.getattr(l_1_c, 'height') - 4)),
                '"/><text class="tick-label" x="',
                escape(environment.getattr(l_2_t, 'x')),
                '" y="',
                escape((environment.getattr(l_1_c, 'axis_y') - 10)),
                '" text-anchor="middle">',
                escape(environment.getattr(l_2_t, 'label')),
                '</text>',
            ))
        l_2_t = missing
        if (not t_3(environment.getattr(l_1_c, 'closed_x'))):
            pass
            t_5.extend((
                '<line class="closed" x1="',
                escape(environment.getattr(l_1_c, 'closed_x')),
                '" y1="',
                escape((environment.getattr(l_1_c, 'axis_y') - 6)),
                '" x2="',
                escape(environment.getattr(l_1_c, 'closed_x')),
                '" y2="',
                escape((environment.getattr(l_1_c, 'height') - 4)),
                '"><title>incident closed</title></line>',
            ))
        for l_2_b in environment.getattr(l_1_c, 'bars'):
            _loop_vars = {}
            pass
            t_5.append(
                '<g class="bar"',
            )
            for (l_3_k, l_3_v) in context.call(environment.getattr(environment.getattr(l_2_b, 'data'), 'items'), _loop_vars=_loop_vars):
                _loop_vars = {}
                pass
                t_5.extend((
                    ' data-',
                    escape(l_3_k),
                    '="',
                    escape(l_3_v),
                    '"',
                ))
            l_3_k = l_3_v = missing
            t_5.extend((
                '><title>',
                escape(environment.getattr(l_2_b, 'tooltip')),
                '</title><text class="row-name" x="6" y="',
                escape(environment.getattr(l_2_b, 'text_y')),
                '">',
                escape(environment.getattr(l_2_b, 'name')),
                '</text><rect class="',
                escape(environment.getattr(l_2_b, 'css')),
                '" x="',
                escape(environment.getattr(l_2_b, 'x')),
                '" y="',
                escape(environment.getattr(l_2_b, 'y')),
                '" width="',
                escape(environment.getattr(l_2_b, 'w')),
                '" height="',
                escape(environment.getattr(l_1_c, 'bar_px')),
                '" rx="2"/><text class="',
                escape(environment.getattr(l_2_b, 'label_css')),
                '" x="',
                escape(environment.getattr(l_2_b, 'lx')),
                '" y="',
                escape(environment.getattr(l_2_b, 'text_y')),
                '" text-anchor="',
                escape(environment.getattr(l_2_b, 'anchor')),
                '">',
                escape(environment.getattr(l_2_b, 'label')),
                '</text></g>',
            ))
        l_2_b = missing
        t_5.append(
            '</svg>',
        )
        return concat(t_5)
    context.exported_vars.add('chart')
    context.vars['chart'] = l_0_chart = Macro(environment, macro, 'chart', ('c',), False, False, False, context.eval_ctx.autoescape)
    yield '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta http-equiv="Content-Security-Policy" content="'
    yield escape((undefined(name='csp') if l_0_csp is missing else l_0_csp))
    yield '"><meta name="viewport" content="width=device-width, initial-scale=1"><title>servewatch incident '
    yield escape(environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'incident_id'))
    yield '</title><style>'
    yield escape((undefined(name='style') if l_0_style is missing else l_0_style))
    yield '</style></head>\n<body>\n<header><h1>servewatch incident <code id="incident-id">'
    yield escape(environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'incident_id'))
    yield '</code> <span class="'
    yield escape((undefined(name='trigger_css') if l_0_trigger_css is missing else l_0_trigger_css))
    yield '" id="trigger">'
    yield escape(environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'trigger'))
    yield '</span></h1>\n'
    if (undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict):
        pass
        yield '<section id="job-verdict" class="'
        yield escape(('hung' if environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'hung') else 'not-hung'))
        yield '"><h2>'
        yield escape(environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'title'))
        yield '</h2><p id="job-verdict-headline"><strong>'
        yield escape(environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'headline'))
        yield '</strong></p>\n'
        if environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'next'):
            pass
            yield '<p id="job-verdict-next"><strong>next:</strong> <code>'
            yield escape(environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'next'))
            yield '</code></p>'
        if environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'missing'):
            pass
            yield '<ul class="missing">'
            for l_1_line in environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'missing'):
                _loop_vars = {}
                pass
                yield '<li>no evidence from '
                yield escape(l_1_line)
                yield '</li>'
            l_1_line = missing
            yield '</ul>'
        if environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'evidence'):
            pass
            yield '<ul class="evidence">'
            for l_1_line in environment.getattr((undefined(name='job_verdict') if l_0_job_verdict is missing else l_0_job_verdict), 'evidence'):
                _loop_vars = {}
                pass
                yield '<li>'
                yield escape(l_1_line)
                yield '</li>'
            l_1_line = missing
            yield '</ul>'
        yield '</section>\n'
    if (undefined(name='verdict') if l_0_verdict is missing else l_0_verdict):
        pass
        yield '<section id="verdict" class="'
        yield escape(('hung' if environment.getattr((undefined(name='verdict') if l_0_verdict is missing else l_0_verdict), 'hung') else 'not-hung'))
        yield '"><h2>Verdict</h2><p id="verdict-headline"><strong>'
        yield escape(environment.getattr((undefined(name='verdict') if l_0_verdict is missing else l_0_verdict), 'headline'))
        yield '</strong></p>\n'
        if environment.getattr((undefined(name='verdict') if l_0_verdict is missing else l_0_verdict), 'next'):
            pass
            yield '<p id="verdict-next"><strong>next:</strong> <code>'
            yield escape(environment.getattr((undefined(name='verdict') if l_0_verdict is missing else l_0_verdict), 'next'))
            yield '</code></p>'
        if environment.getattr((undefined(name='verdict') if l_0_verdict is missing else l_0_verdict), 'evidence'):
            pass
            yield '<ul class="evidence">'
            for l_1_line in environment.getattr((undefined(name='verdict') if l_0_verdict is missing else l_0_verdict), 'evidence'):
                _loop_vars = {}
                pass
                yield '<li>'
                yield escape(l_1_line)
                yield '</li>'
            l_1_line = missing
            yield '</ul>'
        yield '</section>\n'
    if (undefined(name='ranks') if l_0_ranks is missing else l_0_ranks):
        pass
        yield '<section id="ranks"><h2>Evidence per process</h2>\n<table id="rank-table"><thead><tr><th>rank</th><th>pid</th><th>title</th><th>hung frame</th><th>stuck threads</th><th>idle threads</th></tr></thead><tbody>\n'
        for l_1_r in (undefined(name='ranks') if l_0_ranks is missing else l_0_ranks):
            _loop_vars = {}
            pass
            yield '<tr class="rank'
            yield escape((' culprit' if environment.getattr(l_1_r, 'culprit') else cond_expr_undefined("the inline if-expression on line 30 in 'report.html' evaluated to false and no else section was defined.")))
            yield '" data-pid="'
            yield escape(environment.getattr(l_1_r, 'pid'))
            yield '"><td class="num">'
            yield escape(environment.getattr(l_1_r, 'rank'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_r, 'pid'))
            yield '</td><td class="mono">'
            yield escape(environment.getattr(l_1_r, 'title'))
            if environment.getattr(l_1_r, 'culprit'):
                pass
                yield ' <span class="badge culprit">culprit</span>'
            yield '</td><td><code class="'
            yield escape(environment.getattr(l_1_r, 'hung_css'))
            yield '">'
            yield escape(environment.getattr(l_1_r, 'hung'))
            yield '</code></td><td>'
            yield escape((environment.getattr(l_1_r, 'stuck') or '-'))
            yield '</td><td class="dim">'
            yield escape((environment.getattr(l_1_r, 'idle') or '-'))
            yield '</td></tr>\n'
        l_1_r = missing
        yield '</tbody></table>\n</section>\n'
    yield '<dl class="summary">'
    for (l_1_label, l_1_value, l_1_css) in (undefined(name='summary') if l_0_summary is missing else l_0_summary):
        _loop_vars = {}
        pass
        yield '<dt>'
        yield escape(l_1_label)
        yield '</dt><dd'
        if (l_1_css == 'detail'):
            pass
            yield ' id="detail"'
        elif l_1_css:
            pass
            yield ' class="'
            yield escape(l_1_css)
            yield '"'
        yield '>'
        yield escape(l_1_value)
        yield '</dd>'
    l_1_label = l_1_value = l_1_css = missing
    yield '</dl>\n</header>\n<section id="timeline"><h2>Timeline: the server, then the evidence</h2>\n<p class="note">Times in UTC and local time (the time zone of whoever ran <code>servewatch report</code>; <code>TZ</code> chooses it), and from the incident\'s open.'
    if (not (undefined(name='has_history') if l_0_has_history is missing else l_0_has_history)):
        pass
        yield ' No history of the server was recorded (a manual <code>dump</code>, or an agent from before it was kept): the requests in flight and the evidence only.'
    yield '</p>\n<table id="history"><thead><tr><th>UTC</th><th>local</th><th>from open</th><th>what happened</th></tr></thead><tbody>\n'
    for l_1_h in (undefined(name='server') if l_0_server is missing else l_0_server):
        _loop_vars = {}
        pass
        yield '<tr class="h-'
        yield escape(environment.getattr(l_1_h, 'kind'))
        yield ' '
        yield escape(environment.getattr(l_1_h, 'css'))
        yield '" data-kind="'
        yield escape(environment.getattr(l_1_h, 'kind'))
        yield '" data-pid="'
        yield escape(environment.getattr(l_1_h, 'pid'))
        yield '"'
        if t_2(environment.getattr(l_1_h, 'outcome')):
            pass
            yield ' data-outcome="'
            yield escape(environment.getattr(l_1_h, 'outcome'))
            yield '"'
        yield '><td class="num">'
        yield escape(environment.getattr(l_1_h, 'utc'))
        yield '</td><td class="num">'
        yield escape(environment.getattr(l_1_h, 'local'))
        yield '</td><td class="num">'
        yield escape(environment.getattr(l_1_h, 'offset'))
        yield '</td><td>'
        yield escape(environment.getattr(l_1_h, 'what'))
        yield '</td></tr>\n'
    l_1_h = missing
    yield '</tbody></table>\n</section>\n<section id="capture"><h2>Evidence capture (servewatch\'s actions)</h2>\n'
    if (undefined(name='capture') if l_0_capture is missing else l_0_capture):
        pass
        yield escape(context.call((undefined(name='chart') if l_0_chart is missing else l_0_chart), (undefined(name='capture') if l_0_capture is missing else l_0_capture)))
    else:
        pass
        yield '<p>No actions ran.</p>'
    yield '<table id="actions"><thead><tr><th>start ms</th><th>duration ms</th><th>action</th><th>pid</th><th>title</th><th>outcome</th><th>retryable</th><th>detail</th></tr></thead><tbody>\n'
    for l_1_a in (undefined(name='actions') if l_0_actions is missing else l_0_actions):
        _loop_vars = {}
        pass
        yield '<tr><td class="num">'
        yield escape(environment.getattr(l_1_a, 'start'))
        yield '</td><td class="num">'
        yield escape(environment.getattr(l_1_a, 'duration'))
        yield '</td><td>'
        yield escape(environment.getattr(l_1_a, 'action'))
        yield '</td><td class="num">'
        yield escape(environment.getattr(l_1_a, 'pid'))
        yield '</td><td>'
        yield escape(environment.getattr(l_1_a, 'title'))
        yield '</td><td>'
        yield escape(context.call((undefined(name='outcome') if l_0_outcome is missing else l_0_outcome), environment.getattr(l_1_a, 'outcome'), environment.getattr(l_1_a, 'css'), _loop_vars=_loop_vars))
        yield '</td><td>'
        yield escape(environment.getattr(l_1_a, 'retryable'))
        yield '</td><td>'
        yield escape(environment.getattr(l_1_a, 'detail'))
        yield '</td></tr>\n'
    l_1_a = missing
    yield '</tbody></table>\n</section>\n'
    if (undefined(name='stacks') if l_0_stacks is missing else l_0_stacks):
        pass
        yield '<section id="stacks"><h2>Stacks per process</h2>\n'
        for l_1_s in (undefined(name='stacks') if l_0_stacks is missing else l_0_stacks):
            _loop_vars = {}
            pass
            yield '<article class="process" id="pid-'
            yield escape(environment.getattr(l_1_s, 'pid'))
            yield '" data-pid="'
            yield escape(environment.getattr(l_1_s, 'pid'))
            yield '"><h3>pid '
            yield escape(environment.getattr(l_1_s, 'pid'))
            yield ' <span class="title">'
            yield escape(environment.getattr(l_1_s, 'title'))
            yield '</span></h3>\n'
            if environment.getattr(l_1_s, 'hung_frame'):
                pass
                yield '<p class="hung">Hung frame: <code class="hung-frame">'
                yield escape(environment.getattr(l_1_s, 'hung_frame'))
                yield '</code> <span class="badge">'
                yield escape(environment.getattr(l_1_s, 'hung_source'))
                yield '</span></p>'
            if (not t_3(environment.getattr(l_1_s, 'no_stacks'))):
                pass
                yield '<p class="no-stacks">No stacks: '
                yield escape(environment.getattr(l_1_s, 'no_stacks'))
                yield '</p>\n'
                if environment.getattr(l_1_s, 'summary'):
                    pass
                    yield '<p>Summary from the span:</p><ol class="frames summary">'
                    for l_2_line in environment.getattr(l_1_s, 'summary'):
                        _loop_vars = {}
                        pass
                        yield '<li>'
                        yield escape(l_2_line)
                        yield '</li>'
                    l_2_line = missing
                    yield '</ol>'
            if environment.getattr(l_1_s, 'error'):
                pass
                yield '<p class="warning">Stacks file unreadable: '
                yield escape(environment.getattr(l_1_s, 'error'))
                yield '</p>'
            for l_2_t in environment.getattr(l_1_s, 'threads'):
                _loop_vars = {}
                pass
                yield '<details class="thread" open data-thread-id="'
                yield escape(environment.getattr(l_2_t, 'thread_id'))
                yield '" data-thread-name="'
                yield escape(environment.getattr(l_2_t, 'name'))
                yield '"><summary>Thread '
                yield escape(environment.getattr(l_2_t, 'tid'))
                yield ' "'
                yield escape(environment.getattr(l_2_t, 'name'))
                yield '" ('
                yield escape(t_1(environment.getattr(l_2_t, 'frames')))
                yield ' frames)'
                if environment.getattr(l_2_t, 'active'):
                    pass
                    yield '<span class="badge active" title="py-spy: running on a CPU when sampled">on CPU</span>'
                else:
                    pass
                    yield '<span class="badge" title="py-spy: not on a CPU when sampled (blocked or waiting)">off CPU</span>'
                if environment.getattr(l_2_t, 'owns_gil'):
                    pass
                    yield '<span class="badge gil">holds GIL</span>'
                if environment.getattr(l_2_t, 'hung_thread'):
                    pass
                    yield '<span class="badge">hung thread</span>'
                yield '</summary><ol class="frames">'
                for l_3_f in environment.getattr(l_2_t, 'frames'):
                    _loop_vars = {}
                    pass
                    yield '<li class="frame'
                    yield escape((' hung' if environment.getattr(l_3_f, 'hung') else cond_expr_undefined("the inline if-expression on line 56 in 'report.html' evaluated to false and no else section was defined.")))
                    yield '" title="'
                    yield escape(environment.getattr(l_3_f, 'filename'))
                    yield '"><span class="fn">'
                    yield escape(environment.getattr(l_3_f, 'name'))
                    yield '</span> <span class="loc">('
                    yield escape(environment.getattr(l_3_f, 'where'))
                    yield ':'
                    yield escape(environment.getattr(l_3_f, 'line'))
                    yield ')</span></li>'
                l_3_f = missing
                yield '</ol></details>\n'
            l_2_t = missing
            yield '</article>\n'
        l_1_s = missing
        yield '</section>\n'
    if (undefined(name='coredumps') if l_0_coredumps is missing else l_0_coredumps):
        pass
        yield '<section id="coredumps"><h2>CUDA coredumps</h2>\n<table id="coredump-table"><thead><tr><th>pid</th><th>outcome</th><th>size</th><th>bytes</th><th>path</th></tr></thead><tbody>\n'
        for l_1_c in (undefined(name='coredumps') if l_0_coredumps is missing else l_0_coredumps):
            _loop_vars = {}
            pass
            yield '<tr><td class="num">'
            yield escape(environment.getattr(l_1_c, 'pid'))
            yield '</td><td>'
            yield escape(context.call((undefined(name='outcome') if l_0_outcome is missing else l_0_outcome), environment.getattr(l_1_c, 'outcome'), environment.getattr(l_1_c, 'css'), _loop_vars=_loop_vars))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_c, 'size'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_c, 'bytes'))
            yield '</td><td>'
            yield escape(environment.getattr(l_1_c, 'path'))
            yield '</td></tr>\n'
        l_1_c = missing
        yield '</tbody></table>\n</section>\n'
    if (undefined(name='profiles') if l_0_profiles is missing else l_0_profiles):
        pass
        yield '<section id="profiles"><h2>Profiles</h2>\n<table id="profile-table"><thead><tr><th>pid</th><th>outcome</th><th>duration ms</th><th>steps captured</th><th>trace files</th><th>attributes</th></tr></thead><tbody>\n'
        l_1_loop = missing
        for l_1_p, l_1_loop in LoopContext((undefined(name='profiles') if l_0_profiles is missing else l_0_profiles), undefined):
            _loop_vars = {}
            pass
            yield '<tr><td class="num">'
            yield escape(environment.getattr(l_1_p, 'pid'))
            yield '</td><td>'
            yield escape(context.call((undefined(name='outcome') if l_0_outcome is missing else l_0_outcome), environment.getattr(l_1_p, 'outcome'), environment.getattr(l_1_p, 'css'), _loop_vars=_loop_vars))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_p, 'duration'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_p, 'steps'))
            yield '</td><td>'
            l_2_loop = missing
            t_6 = 1
            for l_2_t, l_2_loop in LoopContext(environment.getattr(l_1_p, 'traces'), undefined):
                _loop_vars = {}
                pass
                yield escape(l_2_t)
                if (not environment.getattr(l_2_loop, 'last')):
                    pass
                    yield '<br>'
                t_6 = 0
            l_2_loop = l_2_t = missing
            if t_6:
                pass
                yield '-'
            if environment.getattr(l_1_p, 'traces'):
                pass
                yield ' ('
                yield escape(environment.getattr(l_1_p, 'size'))
                yield ')'
            yield '</td><td>'
            l_2_loop = missing
            for l_2_a, l_2_loop in LoopContext(environment.getattr(l_1_p, 'attributes'), undefined):
                _loop_vars = {}
                pass
                yield escape(l_2_a)
                if (not environment.getattr(l_2_loop, 'last')):
                    pass
                    yield '<br>'
            l_2_loop = l_2_a = missing
            yield '</td></tr>\n'
        l_1_loop = l_1_p = missing
        yield '</tbody></table>\n</section>\n'
    if (undefined(name='show_requests') if l_0_show_requests is missing else l_0_show_requests):
        pass
        yield '<section id="requests"><h2>In-flight requests ('
        yield escape(environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'inflight_count'))
        yield ')</h2>\n<table id="request-table"><thead><tr><th>request id</th><th>pid</th><th>age s</th><th>prompt tokens</th><th>generated tokens</th><th>trace id</th><th>span id</th></tr></thead><tbody>\n'
        for l_1_r in (undefined(name='requests') if l_0_requests is missing else l_0_requests):
            _loop_vars = {}
            pass
            yield '<tr><td>'
            yield escape(environment.getattr(l_1_r, 'id'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_r, 'pid'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_r, 'age'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_r, 'prompt'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_r, 'generated'))
            yield '</td><td><code>'
            yield escape(environment.getattr(l_1_r, 'trace_id'))
            yield '</code></td><td><code>'
            yield escape(environment.getattr(l_1_r, 'span_id'))
            yield '</code></td></tr>\n'
        l_1_r = missing
        yield '</tbody></table>\n</section>\n'
    if (undefined(name='artifacts') if l_0_artifacts is missing else l_0_artifacts):
        pass
        yield '<section id="artifacts"><h2>Artifacts</h2>\n<table id="artifact-table"><thead><tr><th>action</th><th>pid</th><th>size</th><th>path</th></tr></thead><tbody>\n'
        for l_1_f in (undefined(name='artifacts') if l_0_artifacts is missing else l_0_artifacts):
            _loop_vars = {}
            pass
            yield '<tr><td>'
            yield escape(environment.getattr(l_1_f, 'action'))
            yield '</td><td class="num">'
            yield escape(environment.getattr(l_1_f, 'pid'))
            yield '</td><td class="num">'
            if t_3(environment.getattr(l_1_f, 'size')):
                pass
                yield '<span class="missing">missing</span>'
            else:
                pass
                yield '<span title="'
                yield escape(context.call(environment.getattr('{:,}', 'format'), environment.getattr(l_1_f, 'bytes'), _loop_vars=_loop_vars))
                yield ' bytes">'
                yield escape(environment.getattr(l_1_f, 'size'))
                yield '</span>'
            yield '</td><td>'
            yield escape(environment.getattr(l_1_f, 'path'))
            yield '</td></tr>\n'
        l_1_f = missing
        yield '</tbody></table>\n</section>\n'
    if (undefined(name='spans') if l_0_spans is missing else l_0_spans):
        pass
        yield '<section id="spans"><h2>Trace spans ('
        yield escape(t_1(environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'spans')))
        yield ')</h2>\n'
        yield escape(context.call((undefined(name='chart') if l_0_chart is missing else l_0_chart), (undefined(name='spans') if l_0_spans is missing else l_0_spans)))
        yield '\n<p class="mono">from '
        yield escape((undefined(name='span_files') if l_0_span_files is missing else l_0_span_files))
        yield '</p></section>\n'
    if environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'warnings'):
        pass
        yield '<section id="warnings"><h2>Warnings</h2><ul>'
        for l_1_w in environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'warnings'):
            _loop_vars = {}
            pass
            yield '<li class="warning">'
            yield escape(l_1_w)
            yield '</li>'
        l_1_w = missing
        yield '</ul></section>\n'
    yield '<footer>'
    yield escape((undefined(name='footer') if l_0_footer is missing else l_0_footer))
    yield ' from the bundle '
    yield escape(environment.getattr((undefined(name='tl') if l_0_tl is missing else l_0_tl), 'bundle_dir'))
    yield '. Offline page: nothing is loaded.</footer>\n</body></html>'

blocks = {}
debug_info = '2=51&3=68&4=75&5=88&6=109&7=122&11=176&13=182&14=188&15=191&16=197&17=202&18=213&21=225&22=228&23=232&24=237&27=249&30=252&34=280&37=299&39=303&43=331&45=338&48=360&50=363&51=375&52=382&53=387&55=398&56=403&60=450&63=453&67=469&70=473&74=517&75=520&77=522&81=542&84=545&88=568&89=571&90=573&91=575&93=577&94=580&96=589'